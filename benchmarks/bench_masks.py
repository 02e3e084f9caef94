"""Document masks on CPU: what they cost in context-parallel attention, and what packing gains over padding.

    python -m benchmarks.bench_masks attention --seq 4096 8192 --cp 2 --doc-mean 512 --steps 5
    python -m benchmarks.bench_masks packing --seq 1024 --docs 64 --steps 3

``attention``: on ``cp`` gloo ranks, forward + backward of ring attention (the CPU flash kernel, fp32, load
balancing on) over one row of ``seq`` tokens, causal against document-masked at the same token count (documents
of random lengths around ``--doc-mean``, the packing of a fine-tuning batch). Each step runs both in turn, so a
drifting load slows them alike; the time is the median over steps of the slowest rank. The skipped, unmasked,
causal and masked block counts come from the ring's own classification.

``packing``: one process trains the reference ``small`` Transformer on the same ``--docs`` documents (random
lengths 1/16 to 1 of ``seq``), padded (one document a row, padded to ``seq``) against packed (documents laid
end to end in rows of ``seq`` with document masks). Tokens/s counts real tokens only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ndparallel.testing import run_distributed

HEADS, KV_HEADS, DIM = 8, 4, 64
KINDS = ("skipped", "unmasked", "causal", "masked", "pieces")


def _kind(block) -> str:
    """How the ring runs a block: skipped, unmasked, the kernel's causal mask, one masked call, or rectangles."""
    if block is None:
        return "skipped"
    if block.pieces is not None:
        return "pieces"
    return "causal" if block.causal else "masked" if block.mask is not None else "unmasked"


def document_ids(seq: int, mean: int, seed: int = 0) -> torch.Tensor:
    """``[1, seq]`` ids of documents of random lengths (uniform between 1 and ``2 * mean``) laid end to end."""
    generator = torch.Generator().manual_seed(seed)
    ids, doc, start = torch.empty(1, seq, dtype=torch.long), 0, 0
    while start < seq:
        n = int(torch.randint(1, 2 * mean + 1, (1,), generator=generator))
        ids[0, start : start + n] = doc
        start, doc = start + n, doc + 1
    return ids


def _attention_rank(seq: int, mean: int, steps: int) -> dict:
    from ndparallel.distributed.documents import DocumentMask, shard_indices
    from ndparallel.distributed.ring import ring_attention, visible_blocks

    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = seq // cp
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(1, local, HEADS, DIM, generator=generator)
    k, v = (torch.randn(1, local, KV_HEADS, DIM, generator=generator) for _ in range(2))
    ids = document_ids(seq, mean)
    times: dict[str, list[float]] = {"causal": [], "documents": []}
    for step in range(steps + 1):
        for name in times:
            documents = DocumentMask.from_document_ids(ids) if name == "documents" else None  # a fresh mask per step
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            out = ring_attention(*x, None, documents=documents)
            out.sum().backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:  # the first is warm-up
                times[name].append(float(elapsed))
    documents, kinds = DocumentMask.from_document_ids(ids), dict.fromkeys(KINDS, 0)
    for src in range(cp):
        for rows, cols, _ in visible_blocks(rank, src, True, True, local):
            q_index, k_index = shard_indices(seq, cp, rank, True)[rows], shard_indices(seq, cp, src, True)[cols]
            block = documents.block(q_index, k_index, None, (src, rows.start, cols.start))
            kinds[_kind(block)] += 1
    return {"median": {n: statistics.median(t) for n, t in times.items()}, "blocks": kinds, "docs": int(ids.max()) + 1}


def bench_attention(args: argparse.Namespace) -> None:
    print(f"torch {torch.__version__}, cp {args.cp}, {HEADS} heads / {KV_HEADS} kv heads x {DIM}, fp32, 1 thread/rank")
    print("| seq | documents | causal s | document-masked s | ratio | blocks per rank: " + " / ".join(KINDS) + " |")
    print("|---:|---:|---:|---:|---:|---|")
    for seq in args.seq:
        ranks = run_distributed(_attention_rank, args.cp, seq, args.doc_mean, args.steps, threads_per_rank=1)
        med = ranks[0]["median"]
        blocks = " / ".join(str(ranks[0]["blocks"][k]) for k in KINDS)
        print(
            f"| {seq} | {ranks[0]['docs']} | {med['causal']:.3f} | {med['documents']:.3f} | "
            f"{med['documents'] / med['causal']:.2f} | {blocks} |"
        )


def bench_packing(args: argparse.Namespace) -> None:
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.loss import cross_entropy_loss

    torch.set_num_threads(args.threads)
    seq = args.seq[0]
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq // 16, seq + 1, (args.docs,), generator=generator).tolist()
    real = sum(lengths)
    tokens = torch.randint(0, 256, (real,), generator=generator)
    # padded: one document a row, the rest padding (labels -100)
    padded = torch.zeros(len(lengths), seq, dtype=torch.long)
    padded_labels = torch.full((len(lengths), seq), -100)
    # packed: documents end to end, rows of seq, document ids and positions restarting per document
    rows = -(-real // seq)
    packed, packed_labels = torch.zeros(rows * seq, dtype=torch.long), torch.full((rows * seq,), -100)
    ids, positions = torch.full((rows * seq,), -1), torch.zeros(rows * seq, dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        doc = tokens[start : start + n]
        padded[i, :n], padded_labels[i, : n - 1] = doc, doc[1:]
        packed[start : start + n], packed_labels[start : start + n - 1] = doc, doc[1:]
        ids[start : start + n], positions[start : start + n] = i, torch.arange(n)
        start += n
    shape = (rows, seq)
    model = Transformer(TransformerConfig.from_preset("small", max_seq_len=seq))
    runs = {
        "padded": lambda: cross_entropy_loss(model(padded), padded_labels),
        "packed": lambda: cross_entropy_loss(
            model(packed.view(shape), positions.view(shape), document_ids=ids.view(shape)), packed_labels.view(shape)
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps + 1):
        for name, loss_of in runs.items():
            start_time = time.perf_counter()
            loss_of().backward()
            model.zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - start_time)
    pad_fraction = 1 - real / (len(lengths) * seq)
    print(f"torch {torch.__version__}, small preset, seq {seq}, {len(lengths)} documents, {real} real tokens, "
          f"{args.threads} thread(s); padding fraction of the padded batch {pad_fraction:.3f}")  # fmt: skip
    print("| layout | rows | step s | real tokens/s |")
    print("|---|---:|---:|---:|")
    for name, row_count in (("padded", len(lengths)), ("packed", rows)):
        median = statistics.median(times[name])
        print(f"| {name} | {row_count} | {median:.2f} | {real / median:.0f} |")
    gain = statistics.median(times["padded"]) / statistics.median(times["packed"])
    print(f"packed / padded tokens/s: {gain:.2f}x (1 / (1 - padding fraction) = {1 / (1 - pad_fraction):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("attention", "packing"))
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--doc-mean", type=int, default=512)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    (bench_attention if args.what == "attention" else bench_packing)(args)


if __name__ == "__main__":
    main()
