"""The one swap Accelerate's examples get (nothing downloads at test time): GLUE MRPC and bert-base-cased become a
tiny local dataset and a tiny random BERT with the same structure. ``install()`` patches ``datasets.load_dataset``,
``AutoTokenizer.from_pretrained``, ``AutoModelForSequenceClassification.from_pretrained`` and provides
``evaluate.load("glue", "mrpc")`` (accuracy and F1), before the example's own code runs; the example's text is
left as it is. The model records each training loss, so a run's losses can be compared with another's.

The data: sentence pairs over a 40-word vocabulary, the second a reordering of the first with one word swapped
(label 1) or a different sentence (label 0); 96 training pairs, 42 validation pairs (not a multiple of any
batch of the examples, so their last evaluation round is uneven), 10 test pairs."""

from __future__ import annotations

import random
import sys
import types
from typing import Any

import torch

WORDS = (
    "the a cat dog bird sat ran flew on under over near mat log tree house red blue green small big old new quick "
    "slow bright dark today yesterday here there and but then quietly loudly happily sadly very".split()
)
SPLITS = {"train": 96, "validation": 42, "test": 10}
LOSSES: list[float] = []  # training losses of this process, in order


def _pair(rng: random.Random) -> tuple[str, str, int]:
    first = rng.choices(WORDS, k=rng.randint(5, 10))
    if rng.random() < 0.5:
        second = first[:]
        rng.shuffle(second)
        second[rng.randrange(len(second))] = rng.choice(WORDS)
        return " ".join(first), " ".join(second), 1
    return " ".join(first), " ".join(rng.choices(WORDS, k=rng.randint(5, 10))), 0


def load_dataset(*args: Any, **kwargs: Any) -> Any:
    """GLUE MRPC's columns (sentence1, sentence2, label, idx) and splits, made up from a fixed seed."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(1234)
    splits = {}
    for name, size in SPLITS.items():
        rows = [_pair(rng) for _ in range(size)]
        splits[name] = Dataset.from_dict(
            {
                "sentence1": [r[0] for r in rows],
                "sentence2": [r[1] for r in rows],
                "label": [r[2] for r in rows],
                "idx": list(range(size)),
            }
        )
    return DatasetDict(splits)


def tokenizer(*args: Any, **kwargs: Any) -> Any:
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    return BertTokenizer(vocab=vocab)


def model(*args: Any, **kwargs: Any) -> Any:
    """A 2-layer BERT classifier of width 32, randomly initialised from the global generator (the example seeds
    it first); it records each training loss."""
    from transformers import BertConfig, BertForSequenceClassification

    class TinyBert(BertForSequenceClassification):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            outputs = super().forward(*args, **kwargs)
            if self.training and outputs.loss is not None:
                LOSSES.append(outputs.loss.item())
            return outputs

    config = BertConfig(
        vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=kwargs.get("num_labels", 2),
    )  # fmt: skip
    return TinyBert(config)


class Metric:
    """``evaluate.load("glue", "mrpc")``: accuracy and F1 of the positive class over every added batch."""

    def __init__(self) -> None:
        self.predictions: list[int] = []
        self.references: list[int] = []

    def add_batch(self, predictions: Any, references: Any) -> None:
        self.predictions += torch.as_tensor(predictions).tolist()
        self.references += torch.as_tensor(references).tolist()

    def compute(self) -> dict[str, float]:
        pairs = list(zip(self.predictions, self.references, strict=True))
        self.predictions, self.references = [], []
        true_pos = sum(p == r == 1 for p, r in pairs)
        positives, actual = sum(p == 1 for p, _ in pairs), sum(r == 1 for _, r in pairs)
        f1 = 2 * true_pos / (positives + actual) if positives + actual else 0.0
        return {"accuracy": sum(p == r for p, r in pairs) / len(pairs), "f1": f1}


def install() -> None:
    """Patch the example's data, tokenizer, model and metric sources (see the module doc)."""
    import datasets
    import transformers

    datasets.load_dataset = load_dataset
    transformers.AutoTokenizer.from_pretrained = staticmethod(tokenizer)
    transformers.AutoModelForSequenceClassification.from_pretrained = staticmethod(model)
    evaluate = types.ModuleType("evaluate")
    evaluate.load = lambda *args, **kwargs: Metric()
    sys.modules["evaluate"] = evaluate
