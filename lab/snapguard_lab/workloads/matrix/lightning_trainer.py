"""Workload matrix row `lightning`: a PyTorch Lightning Trainer (the `lightning` or
`pytorch_lightning` distribution) on one device, deterministic=True, no logger, no checkpoints;
the module is the matrix's small LM on generated data. Each optimizer step's loss goes to the step
log from on_train_batch_end."""

import tempfile

from _common import SEED, finish, lm_loss, model_for, parser, sample, setup, StepLog

import torch
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]


class Walks(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(i, self.seq)


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args)
    log = StepLog(args)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model_for(args)

        def training_step(self, item, idx):  # type: ignore[no-untyped-def]
            x, y = item
            return lm_loss(self.model(x), y)

        def on_train_start(self) -> None:
            log.start(self.model)

        def on_train_batch_end(self, outputs, item, idx):  # type: ignore[no-untyped-def]
            log.step(self.global_step, outputs["loss"])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    torch.manual_seed(SEED)
    module = Module()
    loader = DataLoader(Walks(args.steps * args.batch, args.seq), batch_size=args.batch, shuffle=False,
                        num_workers=0)
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, num_sanity_val_steps=0,
                         default_root_dir=args.workdir or tempfile.mkdtemp(prefix="lightning-"))
    trainer.fit(module, loader)
    finish(args, module.model, trainer.optimizers[0])


if __name__ == "__main__":
    main()
