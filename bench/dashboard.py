#!/usr/bin/env python3
"""Runs the benchmarks and prints the dashboard table of docs/benchmarks.md.

  bench/dashboard.py build/dev/bench               # run them all, print table
  bench/dashboard.py build/dev/bench --only rpc    # one program
  bench/dashboard.py build/dev/bench --before OLD/bench
      # also run the programs of an older build, alternating with the new
      # ones, and print each figure before and after (same run, same load)
  bench/dashboard.py build/dev/bench --only rpc --repeat 5
      # run each program 5 times (rounds of all programs, so load hits
      # each alike) and judge each row on the median of its per-run ratios
  bench/dashboard.py --from-json DIR               # table from saved runs

Each program prints one JSON object per line (--json). The table lists the
figures that have a target plus a few orientation figures; a ratio is the figure
over the baseline named next to it, both from the same run. With
--repeat N, a row's value and baseline are the medians over the N runs,
its ratio is the median of the N per-run ratios (each still a pair from
one run), and the range of those ratios follows in brackets: on the 2-core
VM, single runs of the RPC rows swing by about 2x. Raw output of every
program is kept under --out (default /tmp/trellis-bench) for the rows the
table leaves out: <program>.after.json, then .after.2.json and so on.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (program file, extra arguments, command shown in the table)
PROGRAMS = {
    "transport": ("transport_bench_tensorpipe", [], "transport_bench_tensorpipe"),
    "store": ("store_bench", [], "store_bench"),
    "rpc": ("rpc_bench", [], "rpc_bench"),
    # The same with each process on half of the CPUs: the VM's scheduling
    # state out of the figures (docs/benchmarks.md, RPC). Orientation rows.
    "rpc_pinned": ("rpc_bench", ["--pin"], "rpc_bench --pin"),
    "dist_autograd": ("dist_autograd_bench", [], "dist_autograd_bench"),
    "collectives": ("collectives_bench", [], "collectives_bench"),
    "ddp": ("ddp_bench", [], "ddp_bench"),
    "hybrid": ("hybrid_bench", [], "hybrid_bench"),
    "elastic": ("elastic_bench", [], "elastic_bench"),
}

# (program, figure, baseline or None, comparison, threshold)
# comparison: "<=", ">=", "<" on the ratio (or on the value when there is no
# baseline); None: shown for orientation, no target.
ROWS = [
    ("transport", "uv_rtt_8B_median", "tcp_rtt_8B_median", "<=", 1.3),
    ("transport", "uv_rtt_8B_median", "tensorpipe_uv_rtt_8B_median", "<=", 1.0),
    ("transport", "uv_throughput_1MiB", "tensorpipe_uv_throughput_1MiB", ">=", 1.0),
    ("transport", "uv_throughput_64MiB", "tcp_64KiB_reads_throughput_64MiB", ">=", 0.9),
    ("transport", "shm_rtt_8B_median", "tcp_rtt_8B_median", "<=", 0.25),
    ("transport", "shm_payload_1MiB", "tensorpipe_shm_payload_1MiB", ">=", 1.0),
    ("transport", "shm_payload_64MiB", "tensorpipe_shm_payload_64MiB", ">=", 1.0),
    ("transport", "cma_throughput_64MiB", "tensorpipe_cma_throughput_64MiB", ">=", 1.0),
    ("store", "set_latency_median", "raw_tcp_rtt_median", None, None),
    ("store", "set_ops_per_s_c16", "raw_tcp_round_trips_per_s", None, None),
    ("store", "set_wait_wakeup_median", "raw_tcp_rtt_after_idle_median", None, None),
    ("rpc", "rpc_uv_noop_rtt_median", "transport_uv_rtt_8B_median", "<=", 1.3),
    ("rpc", "rpc_uv_noop_rtt_median", "grpc_unary_rtt_8B_median", "<", 1.0),
    ("rpc", "rpc_shm_noop_rtt_median", "transport_shm_rtt_8B_median", "<=", 4.0),
    ("rpc", "rpc_shm_noop_rtt_median", "grpc_unary_rtt_8B_median", "<", 1.0),
    ("rpc", "rpc_uv_echo_1KiB", "transport_uv_echo_1KiB", ">=", 0.5),
    ("rpc", "rpc_shm_echo_1KiB", "transport_shm_echo_1KiB", ">=", 0.5),
    ("rpc", "rpc_uv_echo_64KiB", "transport_uv_echo_64KiB", ">=", 0.5),
    ("rpc", "rpc_shm_echo_64KiB", "transport_shm_echo_64KiB", ">=", 0.5),
    ("rpc", "rpc_uv_echo_64MiB", "transport_uv_echo_64MiB", ">=", 0.8),
    ("rpc", "rpc_shm_echo_64MiB", "transport_shm_echo_64MiB", ">=", 0.8),
    ("rpc", "rpc_uv_remote_tohere_median", "rpc_uv_noop_beside_remote_median", "<=", 1.5),
    ("rpc", "rpc_shm_remote_tohere_median", "rpc_shm_noop_beside_remote_median", "<=", 1.5),
    # A tensor's pair: orientation rows (the target is on the number, the
    # figure issue 20 measured; docs/benchmarks.md, RPC).
    ("rpc", "rpc_uv_remote_tohere_tensor_median", "rpc_uv_noop_beside_remote_tensor_median", None, None),
    ("rpc", "rpc_shm_remote_tohere_tensor_median", "rpc_shm_noop_beside_remote_tensor_median", None, None),
    ("rpc", "rpc_shm_call_tensor_beside_remote_median", "rpc_shm_noop_beside_remote_tensor_median", None, None),
    ("rpc", "rpc_shm_remote_tohere_tensor_median", "rpc_shm_call_tensor_beside_remote_median", None, None),
    ("rpc", "rpc_shm_calls_per_s_64_in_flight", None, None, None),
    ("rpc", "rpc_shm_noop_inline_rtt_median", "transport_shm_rtt_8B_median", None, None),
    ("rpc", "rpc_uv_noop_inline_rtt_median", "transport_uv_rtt_8B_median", None, None),
    ("rpc", "rpc_shm_echo_inline_1KiB", "transport_shm_echo_1KiB", None, None),
    ("rpc", "rpc_shm_echo_inline_64KiB", "transport_shm_echo_64KiB", None, None),
    ("rpc", "rpc_shm_idle_worker_threads", None, "<=", 8),
    ("rpc", "transport_uv_handoff_rtt_8B_median", "transport_uv_rtt_8B_median", None, None),
    ("rpc", "rpc_uv_noop_rtt_median", "transport_uv_handoff_rtt_8B_median", None, None),
    ("rpc", "rpc_uv_echo_1KiB", "transport_uv_handoff_echo_1KiB", None, None),
    ("rpc", "transport_uv_handoff_echo_1KiB", "transport_uv_echo_1KiB", None, None),
    ("rpc", "transport_shm_handoff_rtt_8B_median", "transport_shm_rtt_8B_median", None, None),
    ("rpc", "rpc_shm_noop_rtt_median", "transport_shm_handoff_rtt_8B_median", None, None),
    ("rpc", "rpc_shm_echo_1KiB", "transport_shm_handoff_echo_1KiB", None, None),
    ("rpc", "rpc_shm_echo_64KiB", "transport_shm_handoff_echo_64KiB", None, None),
    ("rpc", "transport_shm_handoff_echo_64KiB", "transport_shm_echo_64KiB", None, None),
    ("rpc_pinned", "rpc_shm_noop_rtt_median", "transport_shm_rtt_8B_median", None, None),
    ("rpc_pinned", "rpc_shm_noop_rtt_median", "transport_shm_handoff_rtt_8B_median", None, None),
    ("rpc_pinned", "rpc_shm_echo_1KiB", "transport_shm_echo_1KiB", None, None),
    ("rpc_pinned", "rpc_shm_echo_1KiB", "transport_shm_handoff_echo_1KiB", None, None),
    ("rpc_pinned", "rpc_shm_echo_64KiB", "transport_shm_echo_64KiB", None, None),
    ("rpc_pinned", "rpc_shm_remote_tohere_median", "rpc_shm_noop_beside_remote_median", None, None),
    ("rpc_pinned", "rpc_shm_remote_tohere_tensor_median", "rpc_shm_noop_beside_remote_tensor_median", None, None),
    ("rpc_pinned", "rpc_shm_remote_tohere_tensor_median", "rpc_shm_call_tensor_beside_remote_median", None, None),
    ("dist_autograd", "ps_dist_iter_median", "ps_local_iter_median", "<=", 1.5),
    ("dist_autograd", "ps_dist_iter_median", "ps_floor_iter_median", None, None),
    ("dist_autograd", "ps_floor_iter_median", "ps_local_iter_median", None, None),
    ("dist_autograd", "ps_dist_iter_median", "ps_floor_step_after_iter_median", None, None),
    ("dist_autograd", "ps_floor_step_after_iter_median", "ps_local_iter_median", None, None),
    ("dist_autograd", "ps_dist_iter_median", "ps_floor_handoff_iter_median", None, None),
    ("dist_autograd", "ps_floor_handoff_iter_median", "ps_local_iter_median", None, None),
    ("dist_autograd", "tiny_dist_iter_median", "tiny_floor_handoff_iter_median", None, None),
    ("dist_autograd", "ps_dist_in_backward_iter_median", "ps_local_iter_median", None, None),
    ("dist_autograd", "ps_dist_in_backward_iter_median", "ps_floor_iter_median", None, None),
    ("dist_autograd", "ps_dist_wakeups_per_iter", None, "<=", 6.0),
    ("dist_autograd", "tiny_dist_iter_median", "tiny_local_iter_median", None, None),
    ("collectives", "trellis_allreduce_64MiB_busbw_2r", "gloo_best_allreduce_64MiB_busbw_2r", ">=", 3.0),
    ("collectives", "trellis_allreduce_64MiB_busbw_4r", "gloo_best_allreduce_64MiB_busbw_4r", None, None),
    ("collectives", "trellis_allreduce_64MiB_busbw_2r", "memcpy_64MiB", None, None),
    ("collectives", "trellis_allreduce_8B_median_2r", "gloo_best_allreduce_8B_median_2r", "<=", 0.5),
    ("collectives", "trellis_allreduce_8B_median_4r", "gloo_best_allreduce_8B_median_4r", None, None),
    ("collectives", "trellis_ring_uv_allreduce_64MiB_busbw_2r", "uv_throughput_64MiB", ">=", 0.9),
    ("collectives", "trellis_ring_uv_allreduce_64MiB_busbw_2r", "uv_both_ways_64MiB", None, None),
    ("collectives", "trellis_ring_uv_allreduce_64MiB_busbw_2r", "uv_both_ways_2proc_64MiB", None, None),
    ("ddp", "mlp_trellis_ddp_step_overhead", "mlp_torch_ddp_step_overhead", "<=", 0.5),
    ("ddp", "cnn_trellis_ddp_step_overhead", "cnn_torch_ddp_step_overhead", "<=", 0.5),
    ("ddp", "mlp_trellis_ddp_bucket_view_step_overhead", "mlp_torch_ddp_bucket_view_step_overhead", None, None),
    ("ddp", "cnn_trellis_ddp_bucket_view_step_overhead", "cnn_torch_ddp_bucket_view_step_overhead", None, None),
    ("ddp", "mlp_trellis_ddp_cpu_overhead", "mlp_torch_ddp_cpu_overhead", None, None),
    ("ddp", "cnn_trellis_ddp_cpu_overhead", "cnn_torch_ddp_cpu_overhead", None, None),
    ("ddp", "mlp_trellis_ddp_bucket_view_cpu_overhead", "mlp_torch_ddp_bucket_view_cpu_overhead", None, None),
    ("ddp", "cnn_trellis_ddp_bucket_view_cpu_overhead", "cnn_torch_ddp_bucket_view_cpu_overhead", None, None),
    ("ddp", "mlp_trellis_ddp_step_median", "mlp_single_step_median", None, None),
    ("ddp", "mlp_torch_ddp_step_median", "mlp_torch_single_step_median", None, None),
    ("ddp", "cnn_trellis_ddp_step_median", "cnn_single_step_median", None, None),
    ("ddp", "cnn_torch_ddp_step_median", "cnn_torch_single_step_median", None, None),
    ("ddp", "mlp_trellis_ddp_last_bucket_wait_median", "mlp_torch_ddp_last_bucket_wait_median", None, None),
    ("ddp", "cnn_trellis_ddp_last_bucket_wait_median", "cnn_torch_ddp_last_bucket_wait_median", None, None),
    ("ddp", "cnn_trellis_ddp_hidden_fraction", None, ">=", 0.5),
    ("ddp", "cnn_trellis_ddp_hidden_fraction_vs_torch", "cnn_torch_ddp_hidden_fraction", None, None),
    ("hybrid", "hybrid_2s2t_samples_per_s", "one_process_best_samples_per_s", ">=", 0.5),
    ("hybrid", "floor_2s2t_samples_per_s", "one_process_best_samples_per_s", None, None),
    ("hybrid", "hybrid_2s2t_samples_per_s", "floor_2s2t_samples_per_s", None, None),
    ("hybrid", "hybrid_1s1t_samples_per_s", "one_process_best_samples_per_s", None, None),
    ("hybrid", "floor_1s1t_samples_per_s", "one_process_best_samples_per_s", None, None),
    ("hybrid", "hybrid_1s1t_samples_per_s", "floor_1s1t_samples_per_s", None, None),
    ("hybrid", "hybrid_2s2t_b1024_samples_per_s", "one_process_best_b1024_samples_per_s", None, None),
    ("hybrid", "hybrid_1s1t_b1024_samples_per_s", "one_process_best_b1024_samples_per_s", None, None),
    ("hybrid", "floor_2s2t_b1024_samples_per_s", "one_process_best_b1024_samples_per_s", None, None),
    ("hybrid", "hybrid_2s2t_b1024_samples_per_s", "floor_2s2t_b1024_samples_per_s", None, None),
    ("hybrid", "one_process_batched_samples_per_s", "one_process_samples_per_s", None, None),
    ("hybrid", "hybrid_2s2t_step_overhead_ms", None, None, None),
    ("hybrid", "hybrid_2s2t_b1024_step_overhead_ms", None, None, None),
    ("elastic", "elastic_run_launch_overhead_ms", None, "<=", 50),
    ("elastic", "elastic_run_crash_to_restart_s", None, "<=", 0.1),
    ("elastic", "elastic_run_rendezvous_64_agents_s", None, "<=", 1.0),
    ("elastic", "elastic_run_vs_torchrun_launch", "torchrun_monitor_0.1_launch_2_workers_s", None, None),
    ("elastic", "elastic_run_vs_torchrun_crash_to_restart", "torchrun_monitor_0.1_crash_to_restart_s", None, None),
]

# Targets that this machine's own floor misses: (program, figure, baseline)
# -> (floor, its baseline), both from the same program and runs. A row that
# misses its target while the floor's ratio misses it too reads "✘ (machine
# limit: floor R)": nothing built the way its issue asks reaches the target
# here, and the figure over the floor (an orientation row) is the part that
# is the code's (docs/benchmarks.md, "How to run").
FLOORS = {
    ("rpc", "rpc_uv_noop_rtt_median", "transport_uv_rtt_8B_median"):
        ("transport_uv_handoff_rtt_8B_median", "transport_uv_rtt_8B_median"),
    ("rpc", "rpc_shm_echo_1KiB", "transport_shm_echo_1KiB"):
        ("transport_shm_handoff_echo_1KiB", "transport_shm_echo_1KiB"),
    ("dist_autograd", "ps_dist_iter_median", "ps_local_iter_median"):
        ("ps_floor_handoff_iter_median", "ps_local_iter_median"),
    ("collectives", "trellis_ring_uv_allreduce_64MiB_busbw_2r", "uv_throughput_64MiB"):
        ("uv_both_ways_2proc_64MiB", "uv_throughput_64MiB"),
}


def run_tag(side, i):
    """The file tag of run i (from 1) of a side: after, after.2, after.3..."""
    return side if i == 1 else f"{side}.{i}"


def run_program(bindir, name, outdir, tag):
    exe, extra, _ = PROGRAMS[name]
    path = os.path.join(bindir, exe)
    if name == "transport" and not os.access(path, os.X_OK):
        # Built without libtensorpipe-dev: the same rows minus TensorPipe's.
        path = os.path.join(bindir, "transport_bench")
    if not os.access(path, os.X_OK):
        sys.exit(f"dashboard: {path} is missing or not executable (build it: "
                 f"cmake --build build/dev --target {exe})")
    out = os.path.join(outdir, f"{name}.{tag}.json")
    started = time.monotonic()
    with open(out, "w") as f:
        proc = subprocess.run([path, "--json", *extra], stdout=f,
                              stderr=subprocess.DEVNULL, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"dashboard: {path} exited with {proc.returncode}; "
                 f"its output is in {out}")
    print(f"# {name} ({tag}): {time.monotonic() - started:.0f} s -> {out}",
          file=sys.stderr)
    return load(out)


def load(path):
    figures = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            figures[row["metric"]] = (row["value"], row["unit"])
    return figures


def fmt(value):
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def meets(value, op, threshold):
    return {"<=": value <= threshold, ">=": value >= threshold,
            "<": value < threshold}[op]


def verdict(value, op, threshold):
    return f"{op} {threshold:g} {'✔' if meets(value, op, threshold) else '✘'}"


def ratios_of(runs, figure, base):
    """The per-run ratios figure / base, over the runs that have both."""
    return [r[figure][0] / r[base][0] for r in runs
            if figure in r and base in r and r[base][0] > 0]


def median_figure(runs, name):
    """(median value, unit) of a figure over the runs that have it."""
    values = [r[name] for r in runs if name in r]
    if not values:
        return None
    return statistics.median(v for v, _ in values), values[0][1]


def spread(xs, form=lambda x: f"{x:.2f}"):
    """' (lo–hi)' over several runs, '' for one."""
    return f" ({form(min(xs))}–{form(max(xs))})" if len(xs) > 1 else ""


def dashboard(results, bindir_shown):
    """results: program -> list of runs, each {figure: (value, unit)}."""
    lines = ["| figure | value | baseline | ratio | target | command |",
             "|---|---:|---|---:|---|---|"]
    for prog, figure, base, op, threshold in ROWS:
        runs = results.get(prog) or []
        got = median_figure(runs, figure)
        if got is None:
            continue
        value, unit = got
        cmd = f"`{bindir_shown}/{PROGRAMS[prog][2]}`"
        if base is None:
            values = [r[figure][0] for r in runs if figure in r]
            target = verdict(value, op, threshold) if op else ""
            lines.append(f"| `{figure}` | {fmt(value)} {unit}{spread(values, fmt)} "
                         f"| — | — | {target} | {cmd} |")
            continue
        if median_figure(runs, base) is None:
            continue
        bvalue, bunit = median_figure(runs, base)
        ratios = ratios_of(runs, figure, base)
        if bvalue <= 0 or not ratios:
            # A difference (an overhead) that came out at or below zero in
            # this run: load noise, no ratio to judge.
            target = f"{op} {threshold:g} (baseline <= 0: not judged)" if op else ""
            lines.append(f"| `{figure}` | {fmt(value)} {unit} | `{base}` "
                         f"{fmt(bvalue)} {bunit} | — | {target} | {cmd} |")
            continue
        ratio = statistics.median(ratios)
        target = verdict(ratio, op, threshold) if op else ""
        floor = FLOORS.get((prog, figure, base))
        if op and floor and not meets(ratio, op, threshold):
            floor_ratios = ratios_of(runs, *floor)
            if floor_ratios:
                floor_ratio = statistics.median(floor_ratios)
                if not meets(floor_ratio, op, threshold):
                    target += f" (machine limit: floor {floor_ratio:.2f})"
        lines.append(f"| `{figure}` | {fmt(value)} {unit} | `{base}` "
                     f"{fmt(bvalue)} {bunit} | {ratio:.2f}{spread(ratios)} | "
                     f"{target} | {cmd} |")
    return "\n".join(lines)


def before_after(before, after):
    """Medians over the runs of each side."""
    lines = ["| figure | before | after | after / before |",
             "|---|---:|---:|---:|"]
    seen = set()
    for prog, figure, base, _, _ in ROWS:
        for name in (figure, base):
            if name is None or (prog, name) in seen:
                continue
            seen.add((prog, name))
            b = median_figure(before.get(prog, []), name)
            a = median_figure(after.get(prog, []), name)
            if a is None or b is None:
                continue
            ratio = a[0] / b[0] if b[0] else float("nan")
            lines.append(f"| `{name}` | {fmt(b[0])} {b[1]} | {fmt(a[0])} "
                         f"{a[1]} | {ratio:.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bindir", nargs="?", help="folder with the bench programs")
    p.add_argument("--before", help="older build's bench folder to compare")
    p.add_argument("--only", action="append", choices=sorted(PROGRAMS))
    p.add_argument("--out", default="/tmp/trellis-bench")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each program (default 1); rows use medians")
    p.add_argument("--from-json", help="folder of <program>.after.json files")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    names = args.only or list(PROGRAMS)
    os.makedirs(args.out, exist_ok=True)
    after, before = {}, {}
    if args.from_json:
        for name in names:
            for side, results in (("after", after), ("before", before)):
                runs = []
                for i in itertools.count(1):
                    path = os.path.join(args.from_json,
                                        f"{name}.{run_tag(side, i)}.json")
                    if not os.path.exists(path):
                        break
                    runs.append(load(path))
                if runs:
                    results[name] = runs
    else:
        if not args.bindir:
            p.error("give the bench folder, or --from-json")
        for i in range(1, args.repeat + 1):
            for name in names:
                if args.before:
                    before.setdefault(name, []).append(run_program(
                        args.before, name, args.out, run_tag("before", i)))
                after.setdefault(name, []).append(run_program(
                    args.bindir, name, args.out, run_tag("after", i)))
    shown = os.path.relpath(args.bindir) if args.bindir else "build/dev/bench"
    print(dashboard(after, shown))
    if before:
        print()
        print(before_after(before, after))


if __name__ == "__main__":
    main()
