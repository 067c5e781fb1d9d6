"""The test tools of the ``pdactors`` command: ``harness`` (real engines, real bytes, verified)
and ``chaos`` (faults while transfers stream). Registered on the app in :mod:`pdactors.cli`."""

from __future__ import annotations

import importlib.util
import re
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from pdactors._cli_setup import native_log_aside, native_log_done, setup
from pdactors.config import PROTOCOLS, DataPlaneConfig, default_of

if TYPE_CHECKING:
    from pdactors.testing.harness import HarnessReport

__all__ = ["chaos", "harness"]


def harness(
    requests: Annotated[int, typer.Option(metavar="N", help="Requests to transfer.")] = 8,
    blocks: Annotated[int, typer.Option(metavar="N", help="KV blocks per request.")] = 63,
    layers: Annotated[int, typer.Option(metavar="N", help="Layers (one KV region each).")] = 36,
    block_bytes: Annotated[
        int, typer.Option(metavar="BYTES", help="Bytes per layer per block.")
    ] = 64 * 1024,
    concurrency: Annotated[int, typer.Option(metavar="N", help="Transfers in flight at once.")] = 1,
    protocol: Annotated[
        str, typer.Option(metavar="NAME", help=f"Mooncake protocol: {', '.join(PROTOCOLS)}.")
    ] = default_of(DataPlaneConfig, "protocol"),
    device: Annotated[
        str, typer.Option(metavar="NIC", help="Mooncake device name (RDMA NIC).")
    ] = "",
    kv_device: Annotated[
        str,
        typer.Option(
            metavar="DEVICE",
            help="Where the workers' KV lives: cpu (host memory) or cuda:N (CUDA tensors on "
            "GPU N; each worker in a process of its own; needs torch with CUDA and "
            "pdactors-vllm).",
        ),
    ] = "cpu",
    processes: Annotated[
        bool,
        typer.Option(
            "--processes",
            help="Each P and D worker in a process of its own (implied by --kv-device cuda:N).",
        ),
    ] = False,
    p_tp: Annotated[int, typer.Option(metavar="N", help="P's tensor-parallel workers.")] = 1,
    d_tp: Annotated[int, typer.Option(metavar="N", help="D's tensor-parallel workers.")] = 1,
    kv_heads: Annotated[
        int,
        typer.Option(
            metavar="N", help="The model's KV heads (split --block-bytes); 8 when TP sizes differ."
        ),
    ] = 0,
    secure: Annotated[
        bool, typer.Option("--secure", help="ZMQ CURVE on the side channel (fresh keys).")
    ] = False,
    checksums: Annotated[
        bool,
        typer.Option("--checksums/--no-checksums", help="P sends KV checksums, D verifies them."),
    ] = True,
    corrupt_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Every N requests, corrupt one write in flight (flip, truncate, shift in "
            "turn); passes when the checksums catch each one.",
        ),
    ] = 0,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at INFO, and Mooncake's own log too.")
    ] = False,
) -> None:
    """Run P and D actors with real Mooncake engines, move real KV bytes and verify them.

    Defaults are the reference request: 36 layers x 63 blocks x 64 KiB = 141.75 MiB.
    With --p-tp/--d-tp each engine runs that many workers (one Mooncake engine each), each
    holding its KV heads, and every head is verified on the D worker that holds it.
    With --processes or --kv-device cuda:N every worker runs in a process of its own (this one
    plays the schedulers); --kv-device cuda:0 --protocol nvlink_intra moves GPU memory between
    P's and D's processes on one GPU.
    Exits 1 when any byte is wrong, any transfer fails, or any block is left allocated; 2 when
    the flags do not fit together or the KV device is not there.
    """
    setup(verbose)
    native_log = native_log_aside(verbose)
    import trio

    from pdactors.config import DataPlaneConfig
    from pdactors.testing.harness import run_harness
    from pdactors.testing.kv import KVDeviceUnavailable

    if protocol not in PROTOCOLS:
        raise typer.BadParameter(f"unknown protocol {protocol!r}", param_hint="--protocol")
    _check_kv_device(kv_device, protocol, processes, corrupt_every)
    dataplane = DataPlaneConfig(protocol=protocol, device_name=device)  # type: ignore[arg-type]
    run = partial(
        run_harness,
        requests=requests,
        blocks=blocks,
        layers=layers,
        block_bytes=block_bytes,
        concurrency=concurrency,
        dataplane=dataplane,
        progress=True,
        p_tp=p_tp,
        d_tp=d_tp,
        kv_heads=kv_heads or (8 if p_tp != d_tp else 0),
        secure=secure,
        checksums=checksums,
        corrupt_every=corrupt_every,
        processes=processes,
        kv_device=kv_device,
        on_report=_print_report,  # before the engines' teardown (~1 s each)
    )
    try:
        report = trio.run(run)
    except KVDeviceUnavailable as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    native_log_done(native_log, report.passed, typer.echo)
    raise typer.Exit(0 if report.passed else 1)


def _check_kv_device(kv_device: str, protocol: str, processes: bool, corrupt_every: int) -> None:
    """Refuse flags that do not fit together, and GPU KV where its packages are not installed,
    before anything starts (the workers check the GPU itself as they start)."""
    gpu = re.fullmatch(r"cuda(:\d+)?", kv_device) is not None
    if not gpu and kv_device != "cpu":
        raise typer.BadParameter(f"{kv_device!r}: use cpu or cuda:N", param_hint="--kv-device")
    if protocol == "nvlink_intra" and not gpu:
        raise typer.BadParameter(
            "nvlink_intra moves GPU memory: give --kv-device cuda:N", param_hint="--protocol"
        )
    if corrupt_every and (gpu or processes):
        raise typer.BadParameter(
            "corruption in flight needs the in-process harness (no --processes, KV on cpu)",
            param_hint="--corrupt-every",
        )
    missing = [m for m in ("torch", "pdactors_vllm") if gpu and importlib.util.find_spec(m) is None]
    if missing:
        raise typer.BadParameter(
            f"KV on {kv_device} needs torch with CUDA and pdactors-vllm (integrations/vllm);"
            f" not importable here: {', '.join(missing)}",
            param_hint="--kv-device",
        )


def _print_report(report: HarnessReport) -> None:
    typer.echo(report.summary())
    typer.echo("PASS: every byte verified, no block leaked" if report.passed else "FAIL")


def chaos(
    seconds: Annotated[
        float, typer.Option(metavar="SECONDS", help="How long to inject faults.")
    ] = 30.0,
    seed: Annotated[
        int, typer.Option(metavar="N", help="Seed of the fault schedule and the transfers.")
    ] = 0,
    concurrency: Annotated[int, typer.Option(metavar="N", help="Transfers in flight at once.")] = 8,
    netns: Annotated[
        bool,
        typer.Option(
            "--netns",
            help="P in a network namespace of its own, joined by a veth pair (root); adds "
            "cut links and, where the kernel has netem, packet loss.",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at INFO, and Mooncake's own log too.")
    ] = False,
) -> None:
    """Move transfers through a P process and a D receiver while killing, stopping and
    restarting P, aborting on D, dropping and delaying messages, failing writes and restarting
    the bootstrap. Prints per fault kind how fast the transfers it hit ended, then
    "chaos: N transfers, N ok, N failed, N hung, N leaked blocks". Also corrupts writes in
    flight (a flipped byte, a short run, a run one byte off). Exits 1 if any transfer hung,
    any block leaked, any delivered byte was wrong or any corrupted transfer was delivered.
    """
    setup(verbose)
    native_log = native_log_aside(verbose)
    import trio

    from pdactors.testing.chaos import run_chaos

    typer.echo(f"chaos: {seconds:g} s, seed {seed}, concurrency {concurrency}")
    run = partial(
        run_chaos, seconds=seconds, seed=seed, concurrency=concurrency, progress=True, netns=netns
    )
    report = trio.run(run)
    typer.echo(report.table())
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(report.reasons.items()))
    typer.echo(f"failures by reason: {reasons or 'none'}")
    typer.echo(report.corruption_line())
    typer.echo(report.last_line())
    native_log_done(native_log, report.passed, typer.echo)
    raise typer.Exit(0 if report.passed else 1)
