"""Accelerate's tutorial loop (Accelerator(), prepare, backward, save(unwrap_model(model).state_dict())), an
Accelerate script: tests/accelerator/twin.py runs it as it is and with its imports renamed to ndparallel. Each
process writes its losses, learning rates and evaluation (gathered predictions) to ``rank<r>.json``; the main
process saves ``model.pt`` (both in the working directory)."""

import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

out = Path(".")


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, 12, generator=generator)
    labels = (features[:, :3].sum(dim=1) > 0).long() + (features[:, 3] > 1).long()
    return TensorDataset(features, labels)


def main() -> None:
    accelerator = Accelerator()
    set_seed(42)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = DataLoader(data(70, 0), batch_size=4, shuffle=True)  # 18 batches, the last of 2 samples
    evaluation = DataLoader(data(27, 1), batch_size=4)  # 27 samples: the last round is filled up
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(train) * 2)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)
    result = {"losses": [], "lrs": [], "accuracy": [], "predictions": []}
    for _epoch in range(2):
        model.train()
        for features, labels in train:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            result["losses"].append(loss.item())
            result["lrs"].append(scheduler.get_last_lr()[0])
        model.eval()
        predictions, references = [], []
        for features, labels in evaluation:
            with torch.no_grad():
                guess = model(features).argmax(dim=-1)
            guess, labels = accelerator.gather_for_metrics((guess, labels))
            predictions += guess.tolist()
            references += labels.tolist()
        result["predictions"].append(predictions)
        result["accuracy"].append(sum(p == r for p, r in zip(predictions, references, strict=True)) / len(references))
    accelerator.wait_for_everyone()
    accelerator.save(accelerator.unwrap_model(model).state_dict(), out / "model.pt")
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
