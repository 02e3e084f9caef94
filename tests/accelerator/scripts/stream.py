"""An Accelerate loop over an ``IterableDataset`` (a stream: Accelerate dispatches its batches from the first
process), an Accelerate script run by tests/accelerator/twin.py as it is and with its imports renamed. Each
process writes its losses and the gathered evaluation to ``rank<r>.json`` in the working directory."""

import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


class Stream(IterableDataset):
    """``samples`` (features, label) pairs made from a fixed seed, read in order."""

    def __init__(self, samples: int, seed: int):
        self.samples, self.seed = samples, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.samples):
            features = torch.randn(6, generator=generator)
            yield features, int(features[:2].sum() > 0)


def main() -> None:
    accelerator = Accelerator()
    set_seed(7)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(Stream(42, 0), batch_size=4)  # 10 full batches and one of 2: the last step is short
    evaluation = DataLoader(Stream(23, 1), batch_size=4)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    result = {"losses": [], "predictions": []}
    for _epoch in range(2):
        model.train()
        for features, labels in train:
            loss = nn.functional.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(loss.item())
        model.eval()
        predictions = []
        for features, labels in evaluation:
            with torch.no_grad():
                guess = model(features).argmax(dim=-1)
            guess, labels = accelerator.gather_for_metrics((guess, labels))
            predictions += list(zip(guess.tolist(), labels.tolist(), strict=True))
        result["predictions"].append(predictions)
    with open(f"rank{accelerator.process_index}.json", "w") as out:
        json.dump(result, out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
