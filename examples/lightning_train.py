"""Train a torchvision ResNet with PyTorch Lightning, fed by gpufeed Loaders through a LightningDataModule.

    python examples/lightning_train.py --train stores/train --val stores/val [--epochs 2] [--accelerator gpu]

What it shows:
- the Loaders are made in `setup()`, once Lightning knows the device and has started
  torch.distributed (each rank then reads its own shard; no DistributedSampler is involved);
- the validation Loader has `restart=True`: Lightning's sanity check takes two batches and drops
  the pass, and every validation epoch after it still sees every sample from the first batch;
- the training Loader's position goes into Lightning's checkpoints (`state_dict` /
  `load_state_dict` of the DataModule), so a resumed run continues with the batches that remained.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
import torchvision

import gpufeed
from gpufeed.augment import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize


class GpufeedData(pl.LightningDataModule):
    def __init__(self, train: str, val: str, batch_size: int = 256, size: int = 224, resize: int = 256):
        super().__init__()
        self.paths, self.batch_size, self.size, self.resize = (train, val), batch_size, size, resize
        self.train: gpufeed.Loader | None = None
        self.val: gpufeed.Loader | None = None
        self._pending_state: dict | None = None

    def setup(self, stage: str) -> None:
        if self.train is not None:
            return
        device = self.trainer.strategy.root_device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.train = gpufeed.Loader(self.paths[0], batch_size=self.batch_size, device=device, dtype=dtype,
                                    augment=[RandomResizedCrop(self.size), RandomHorizontalFlip(), Normalize()])
        self.val = gpufeed.Loader(self.paths[1], batch_size=self.batch_size, device=device, dtype=dtype,
                                  shuffle=False, drop_last=False, restart=True,
                                  augment=[Resize(self.resize), CenterCrop(self.size), Normalize()])
        if self._pending_state is not None:
            self.train.load_state_dict(self._pending_state)

    def train_dataloader(self) -> gpufeed.Loader:
        return self.train

    def val_dataloader(self) -> gpufeed.Loader:
        return self.val

    def state_dict(self) -> dict:
        return {"train": self.train.state_dict()} if self.train is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "train" in state:
            self._pending_state = state["train"]
            if self.train is not None:
                self.train.load_state_dict(state["train"])

    def teardown(self, stage: str) -> None:  # optional: the loaders would also stop on their own
        for loader in (self.train, self.val):
            if loader is not None:
                loader.close()
        self.train = self.val = None


class Classifier(pl.LightningModule):
    def __init__(self, classes: int, lr: float = 0.1):
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=classes)
        self.lr = lr
        self.val_seen: list[int] = []  # samples per finished validation epoch (sanity check excluded)
        self._seen = 0

    def training_step(self, batch, _):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images).float(), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        images, labels = batch
        correct = (self.model(images).argmax(1) == labels).sum()
        self.log("val_acc", correct / len(labels), prog_bar=True, batch_size=len(labels))
        self._seen += len(labels)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_seen.append(self._seen)
        self._seen = 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-5)


def main(argv: list[str] | None = None) -> tuple[Classifier, GpufeedData]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto")
    a = p.parse_args(argv)
    data = GpufeedData(a.train, a.val, a.batch_size, a.size, a.resize)
    model = Classifier(len(gpufeed.open(a.train).classes))
    trainer = pl.Trainer(max_epochs=a.epochs, accelerator=a.accelerator, devices=a.devices, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=2,
                         precision="bf16-mixed" if torch.cuda.is_available() else "32-true")
    trainer.fit(model, datamodule=data)
    return model, data


if __name__ == "__main__":
    main()
