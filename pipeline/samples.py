"""Training's periodic samples (`sample.*`): the prompts, checked before step 1, and rank 0's
KV-cache generation from an unsharded eager copy of the model being trained."""

from __future__ import annotations

import tiktoken
from torch import nn

from lmforge.data_prep.tokenizer import decode, encode_prompt, eot_id
from lmforge.model import GPT, ModelConfig, generate
from lmforge.pipeline.checkpoint.format import full_model_state
from lmforge.pipeline.config import ConfigError, SampleConfig
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision


class Samples:
    def __init__(self, sc: SampleConfig, enc: tiktoken.Encoding, model_cfg: ModelConfig,
                 precision: Precision, info: DistInfo, seed: int):
        self.sc, self.enc, self.model_cfg = sc, enc, model_cfg
        self.precision, self.info, self.seed = precision, info, seed
        self.copy: GPT | None = None
        self.prompts = [encode_prompt(enc, text) for text in sc.prompts]
        # Each checked to leave room for new tokens: a prompt too long for the model stops the
        # run before step 1, not at its last step.
        for i, ids in enumerate(self.prompts):
            try:
                sc.params().fit(len(ids), model_cfg.max_seq_len)
            except ValueError as e:
                raise ConfigError(f"sample.prompts[{i}] (with the end-of-text token every prompt "
                                  f"starts with): {e}, or raise model.max_seq_len") from None

    def __call__(self, module: nn.Module) -> list[str]:
        """The prompts and their continuations on rank 0 (all ranks join the weight gather)."""
        if not self.prompts:  # sample.prompts = []: samples are off
            return []
        state = full_model_state(module)
        if not self.info.is_main:
            return []
        if self.copy is None:
            self.copy = GPT(self.model_cfg).to(self.info.device)
        self.copy.load_state_dict(state, strict=False)
        sampling = self.sc.params(seed=self.seed).fit(max(map(len, self.prompts)),
                                                      self.model_cfg.max_seq_len)
        with self.precision.autocast(self.copy):
            outs = generate(self.copy, self.prompts, sampling, stop_token=eot_id(self.enc))
        return [p + decode(self.enc, o) for p, o in zip(self.sc.prompts, outs, strict=True)]
