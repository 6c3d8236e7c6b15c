"""Training's periodic samples (`sample.*`): the prompts, checked before step 1, and rank 0's
KV-cache generation from the model being trained, run eagerly: the module itself (one process,
DDP), or under FSDP2 an unsharded copy gathered for the round and dropped after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import tiktoken
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from lmforge.data_prep.tokenizer import decode, encode_prompt, eot_id
from lmforge.model import GPT, ModelConfig, generate
from lmforge.pipeline.checkpoint.format import full_model_state
from lmforge.pipeline.config import ConfigError, SampleConfig
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision


@contextmanager
def eager_model(module: nn.Module) -> Iterator[GPT]:
    """The trained GPT as evals and samples call it: DDP's inner module (its hooks are for
    backward), FSDP2's as it is (still sharded: a forward is collective), every compiled region
    run eagerly (its graphs are for training's shapes; evals' would each recompile)."""
    model = module.module if isinstance(module, DistributedDataParallel) else module
    with torch.compiler.set_stance("force_eager"):
        yield model


class Samples:
    def __init__(self, sc: SampleConfig, enc: tiktoken.Encoding, model_cfg: ModelConfig,
                 precision: Precision, info: DistInfo, seed: int):
        self.sc, self.enc, self.model_cfg = sc, enc, model_cfg
        self.precision, self.info, self.seed = precision, info, seed
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
        """The prompts and their continuations on rank 0 (under FSDP all ranks join the gather)."""
        if not self.prompts:  # sample.prompts = []: samples are off
            return []
        with eager_model(module) as model:
            if isinstance(model, FSDPModule):
                state = full_model_state(model)
                if not self.info.is_main:
                    return []
                model = GPT(self.model_cfg).to(self.info.device)
                model.load_state_dict(state, strict=False)  # a tied head may be absent
            if not self.info.is_main:
                return []
            sampling = self.sc.params(seed=self.seed).fit(max(map(len, self.prompts)),
                                                          self.model_cfg.max_seq_len)
            with self.precision.autocast(model):
                outs = generate(model, self.prompts, sampling, stop_token=eot_id(self.enc))
        return [p + decode(self.enc, o) for p, o in zip(self.sc.prompts, outs, strict=True)]
