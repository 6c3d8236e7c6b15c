"""`lmforge prepare --merge DIR...`: join the outputs of `--part 1/N ... N/N` into one dataset.

Every part must come from one prepare run (same arguments but --part, same tokenizer); the
shards are renumbered part by part (hard links where possible) under one manifest, so the result
is what one run over the whole input would have produced, up to the order of the shards.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.outdir import TOKENIZER_DIR, resume_state, save_state
from lmforge.data_prep.prepare import part_slice, write_errors
from lmforge.data_prep.safe_files import atomic_write_bytes, check_file, open_file
from lmforge.data_prep.shards import (
    FORMAT_VERSION,
    SPLITS,
    Manifest,
    ShardInfo,
    check_shard,
    copy_plain_tree,
    index_path,
    load_manifest,
    read_doc_index,
    shard_name,
)
from lmforge.data_prep.tokenizer import dataset_tokenizer_meta


def merge(dirs: list[Path], out: Path) -> Manifest:
    """Join the part directories `dirs` (any order) into `out`; a no-op when already done."""
    parts = ordered_parts([load_manifest(d) for d in dirs])
    for m in parts:  # each part's files, as a reader of it would take them
        dataset_tokenizer_meta(m.data_dir)
        for s in m.shards:
            check_shard(m.data_dir / s.file, s, m.vocab_size, False, m.dtype)
            read_doc_index(m.data_dir / s.file, s.tokens, s.index_sha256)
    identity = {k: v for k, v in parts[0].args.items() if k != "part"}
    identity |= {"part": None, "merged_parts": len(parts)}
    finished, _ = resume_state(out, identity)
    if finished:
        return load_manifest(out)
    with write_errors(out, []):
        out.mkdir(parents=True, exist_ok=True)
        save_state(out, identity, [])
        copy_plain_tree(parts[0].data_dir / TOKENIZER_DIR, out / TOKENIZER_DIR, dirs_exist_ok=True)
        shards = link_shards(parts, out)
    m0 = parts[0]
    # Counts add up over the parts; what every part shares (the val threshold and floor, the
    # fingerprint of the files all of them read) is the first part's.
    shared = ("val_threshold", "val_floor", "source_files")
    stats = {k: sum(m.stats.get(k, 0) for m in parts) for k in m0.stats if k not in shared}
    merged = Manifest(version=FORMAT_VERSION, vocab_size=m0.vocab_size, eot_id=m0.eot_id,
                      tokenizer=m0.tokenizer, source=m0.source, args=identity,
                      stats=stats | {k: m0.stats.get(k) for k in shared},
                      dtype=m0.dtype, shards=shards, data_dir=out)
    with write_errors(out, []):
        merged.save(out)
    return merged


def ordered_parts(parts: list[Manifest]) -> list[Manifest]:
    """The manifests sorted by part index; DataError unless they are parts 1/N..N/N of one run."""
    def rest(m: Manifest) -> dict:
        return {k: v for k, v in m.args.items() if k != "part"}

    for m in parts:
        if rest(m) != rest(parts[0]) or m.tokenizer != parts[0].tokenizer:
            raise DataError(f"{m.data_dir} was prepared with other arguments or tokenizer than "
                            f"{parts[0].data_dir}; merge only parts of one prepare run")
        # Same arguments do not make one run: the files may have changed between the parts,
        # or another lmforge may have split train/val by another rule.
        for key, why in (("source_files", "the files of --source differ between them (names, "
                                          "sizes or modification times: edited between the parts, "
                                          "or copies that did not keep their times: rsync -a, "
                                          "cp -p)"),
                         ("val_threshold", "they split train/val at different thresholds "
                                           "(prepared by different lmforge versions)")):
            if m.stats.get(key) != parts[0].stats.get(key):
                raise DataError(f"{m.data_dir} and {parts[0].data_dir} are not parts of one run: "
                                f"{why}; prepare every part again from the same files")
    slices = [part_slice(m.args.get("part")) for m in parts]
    n = slices[0][1]
    if sorted(slices) != [(i, n) for i in range(n)]:
        have = ", ".join(str(m.args.get("part")) for m in parts)
        raise DataError(f"--merge needs each of parts 1/{n}..{n}/{n} exactly once, got {have}")
    return [m for _, m in sorted(zip(slices, parts, strict=True), key=lambda x: x[0])]


def link_shards(parts: list[Manifest], out: Path) -> list[ShardInfo]:
    """Each split's shards of all parts, in part order, renumbered into `out`."""
    infos = []
    for sp in SPLITS:
        shards = [(m, s) for m in parts for s in m.shards if s.split == sp]
        for i, (m, s) in enumerate(shards):
            name = shard_name(sp, i)
            _link_or_copy(m.data_dir / s.file, out / name)
            if os.path.lexists(index_path(m.data_dir / s.file)):  # none in older parts: checked
                _link_or_copy(index_path(m.data_dir / s.file), index_path(out / name))
            infos.append(ShardInfo(name, sp, s.tokens, s.documents, s.sha256, s.index_sha256))
    return infos


def _link_or_copy(src: Path, dst: Path) -> None:
    # A link would take in whatever file it points to, a device would be copied without end.
    check_file(src, what="shard to merge")
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem
        with open_file(src, "rb", what="shard to merge") as f:
            atomic_write_bytes(dst, iter(lambda: f.read(1 << 22), b""), what="merged shard")
        return
    os.replace(tmp, dst)
