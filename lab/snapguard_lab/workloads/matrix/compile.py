"""Workload matrix rows `compile` and `compile-reduce-overhead`: the model under torch.compile
(--mode default, or reduce-overhead: CUDA graphs), inductor's worker pool as it comes.

On a GPU inductor starts its compile worker pool itself (a SubprocPool sidecar and its workers,
which hold NVML handles): the blocker that snapguard's take-point hook resolves by shutting the
pool down once compilation is idle. On the CPU inductor compiles C++ in threads and starts no
pool; --warm-pool starts it as inductor does on a GPU (AsyncCompile.warm_pool and wakeup), so the
mechanism runs there too. --recompile-at N feeds step N a shorter sequence: dynamo compiles again,
and on a GPU the pool comes back, lazily; with --warm-pool the pool is asked for again at that step
the way inductor's Triton path asks for it. The result says which pool processes there were."""

from _common import batch, finish, lm_loss, model_for, parser, setup, StepLog

import torch


def pool_pids() -> list[int]:
    import sys

    mod = sys.modules.get("torch._inductor.async_compile")
    pids: list[int] = []
    for pool in list(getattr(mod, "_pool_set", None) or []):
        process = getattr(pool, "process", None)
        if process is not None:
            pids.append(process.pid)
        pids += list(getattr(pool, "_processes", None) or {})
    return sorted(pids)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mode", choices=("default", "reduce-overhead"), default="default")
    ap.add_argument("--warm-pool", action="store_true")
    ap.add_argument("--recompile-at", type=int, default=0)
    args = ap.parse_args()
    device = setup(args)
    model = model_for(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    fwd = torch.compile(model, mode=None if args.mode == "default" else args.mode)
    if args.warm_pool:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        AsyncCompile.wakeup()
    graphs = args.mode == "reduce-overhead"
    log = StepLog(args)
    log.start(model)
    seen: dict[str, list[int]] = {"pool_pids_at_start": pool_pids()}
    for step in range(1, args.steps + 1):
        seq = args.seq // 2 if step == args.recompile_at else args.seq
        x, y = batch(step, args.batch, seq, device)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = lm_loss(fwd(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.step(step, loss)
        if step == args.recompile_at:
            if args.warm_pool:
                from torch._inductor.async_compile import AsyncCompile

                AsyncCompile.use_process_pool()  # what each Triton kernel's compile asks first
            seen["pool_pids_after_recompile"] = pool_pids()
        if step == 2:
            seen["pool_pids_after_compile"] = pool_pids()
    finish(args, model, opt, **seen, pool_pids_at_end=pool_pids())


if __name__ == "__main__":
    main()
