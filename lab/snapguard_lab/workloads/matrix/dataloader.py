"""Workload matrix row `dataloader`: a DataLoader with forked worker processes (4 by default),
persistent across epochs, pinned memory on the GPU. The workers are forked after the model is on
the device, so on a GPU they inherit the CUDA process's /dev/nvidia* handles: the blocker that
snapguard's take-point hook resolves (the handles are dropped in each child right after the fork).
Samples are made from their index alone; the shuffle is seeded."""

from _common import SEED, finish, lm_loss, model_for, parser, sample, setup, StepLog

import torch
from torch.utils.data import DataLoader, Dataset


class Walks(Dataset):
    def __init__(self, n: int, seq: int, features: int) -> None:
        self.n, self.seq, self.features = n, seq, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y = sample(i, self.seq)
        if not self.features:
            return x, y
        # a dense per-sample tensor (an image's size): what makes batches in flight large
        g = torch.Generator().manual_seed(i)
        return x, y, torch.rand(self.features, generator=g)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--features", type=int, default=0, help="floats of dense data per sample (0: none)")
    args = ap.parse_args()
    device = setup(args)
    model = model_for(args).to(device)  # CUDA is initialised before the workers fork
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loader = DataLoader(Walks(args.samples, args.seq, args.features), batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(SEED), num_workers=args.workers,
                        pin_memory=device == "cuda", persistent_workers=args.workers > 0,
                        multiprocessing_context="fork" if args.workers else None, drop_last=True)
    log = StepLog(args)
    log.start(model)
    step, workers = 0, []
    while step < args.steps:
        for item in loader:
            x, y = item[0].to(device, non_blocking=True), item[1].to(device, non_blocking=True)
            loss = lm_loss(model(x), y)
            if args.features:  # the dense part joins the loss, so that it matters
                loss = loss + 1e-3 * item[2].to(device).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            log.step(step, loss)
            it = getattr(loader, "_iterator", None)
            workers = sorted(w.pid for w in getattr(it, "_workers", []) or [])
            if step >= args.steps:
                break
    finish(args, model, opt, worker_pids=workers)


if __name__ == "__main__":
    main()
