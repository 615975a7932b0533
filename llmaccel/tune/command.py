"""`llmaccel tune --slo "ttft_p99<=1s,tpot_p99<=100ms"`: search the batch flags (and, with --search-dtypes, the
weight formats) for the highest goodput at a latency SLO, write the winner as a config file for
`llmaccel serve --config`, and serve it once more, fresh, to check that it holds.

    llmaccel tune --slo "ttft_p99<=1s,tpot_p99<=100ms" --dataset chinese --output tuned.yaml
    llmaccel serve --config tuned.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.bench import datasets
from llmaccel.bench import serve as bench_serve
from llmaccel.bench.provenance import provenance
from llmaccel.config import SchedulerConfig
from llmaccel.config_file import write_config_file
from llmaccel.platform import machine_record
from llmaccel.tune import report
from llmaccel.tune.runner import RunPrompts, candidate_runner, config_command, measure_at, serve_command, served
from llmaccel.tune.search import VARIANTS, Candidate, SearchSpace, best_result, coordinate_search, count_runs
from llmaccel.tune.slo import parse_slo


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write whole numbers separated by commas, e.g. 16,64,256") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more numbers >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slo", required=True,
                        help='the objectives, e.g. "ttft_p99<=1s,tpot_p99<=100ms": METRIC_STAT<=LIMIT joined by '
                             "commas; METRIC ttft, tpot, itl or e2el; STAT p50..p100 or mean; LIMIT in s, ms "
                             "(the default) or us")
    parser.add_argument("--model", default="smollm2-135m", help="the model to serve (alias, directory or GGUF file)")
    parser.add_argument("--dataset", choices=datasets.DATASETS, default="chinese",
                        help="the prompts (every run sends the same ones, tagged #k: against the prefix cache)")
    parser.add_argument("--dataset-path", type=Path, help="the ShareGPT JSON file for --dataset sharegpt")
    parser.add_argument("--num-prompts", type=int, default=96, help="requests per run")
    parser.add_argument("--output-len", type=int, help="tokens per request (default: the dataset's own lengths)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens for --dataset random")
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates its full length")
    parser.add_argument("--max-num-seqs", type=_int_list, default=SearchSpace.max_num_seqs,
                        help="values of --max-num-seqs to try (comma list)")
    parser.add_argument("--max-num-batched-tokens", type=_int_list, default=SearchSpace.max_num_batched_tokens,
                        help="values of --max-num-batched-tokens to try (comma list)")
    parser.add_argument("--search-dtypes", action="store_true",
                        help=f"also try the weight formats ({', '.join(VARIANTS[1:])}) beside the server's default")
    parser.add_argument("--rate-steps", type=int, default=3,
                        help="bisection runs between the last rate met and the first missed (each halves the "
                             "interval; the defaults get two more)")
    parser.add_argument("--margin", type=float, default=0.05,
                        help="a later configuration is probed this share above the best run's arrival rate; missing "
                             "there ends its search")
    parser.add_argument("--passes", type=int, default=2, help="passes over the flags (a pass ends early when "
                        "nothing moved)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="arrivals' gamma shape (1: Poisson)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt order and the arrivals")
    parser.add_argument("--serve-args", default="", help="further flags for every server, e.g. \"--dtype bf16\"")
    parser.add_argument("--output", type=Path, default=Path("tuned.yaml"),
                        help="the config file written for `llmaccel serve --config`")
    parser.add_argument("--result-dir", type=Path, default=Path("tune-results"),
                        help="where the runs (tune.json), the plot (tune-frontier.png) and the servers' logs go")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip serving the defaults and the winner (from its config file) once more, fresh, at the "
                             "winner's rate")


def _space(args: argparse.Namespace) -> SearchSpace:
    return SearchSpace(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       variants=VARIANTS if args.search_dtypes else ("default",))


def _defaults() -> Candidate:
    scheduler = {f.name: f.default for f in fields(SchedulerConfig)}
    return Candidate(scheduler["max_num_seqs"], scheduler["max_num_batched_tokens"])


def run(args: argparse.Namespace) -> int:
    objectives = parse_slo(args.slo)  # bad input fails before any server starts
    if args.rate_steps < 0 or args.passes < 1 or not 0 <= args.margin < 1:
        raise ValueError("--rate-steps must be >= 0, --passes >= 1 and --margin in [0, 1)")
    tokenizer = bench_serve.tokenizer_for(argparse.Namespace(tokenizer=None, model=args.model))
    pool_args = argparse.Namespace(**{"range_ratio": 0.0, **vars(args), "num_prompts": args.num_prompts + 4})
    prompts = RunPrompts(bench_serve.sample_requests(pool_args, tokenizer), args.num_prompts, args.seed)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    logs = args.result_dir / "server-logs"
    logs.mkdir(exist_ok=True)
    space, start = _space(args), _defaults()
    runs: list[dict] = []
    bar = tqdm(total=1 + sum(len(values) for _, values in space.axes()), desc="tune", unit="config")
    run_candidate = candidate_runner(args, tokenizer, prompts, objectives, logs, runs, on_run=bar.write)
    results = coordinate_search(space, start, run_candidate, passes=args.passes, on_result=lambda _: bar.update(1))
    bar.total = bar.n
    bar.close()
    best = best_result(results)
    record = {"slo": [str(o) for o in objectives], "model": args.model, "dataset": args.dataset,
              "num_prompts": args.num_prompts, "space": {k: list(v) for k, v in vars(space).items()},
              "runs": runs, "configurations": [report.result_record(r) for r in results],
              "defaults": start.config(), "defaults_goodput": results[0].goodput,
              "machine": machine_record(), **provenance(), "server_logs": str(logs)}
    if best is None:
        record["closest"] = report.closest_text(results, objectives)
        _write(args, record, results, objectives)
        print(f"no configuration met {args.slo} in {count_runs(results)} runs; {record['closest']}",
              file=sys.stderr)
        return 1
    defaults_goodput = results[0].goodput
    if best is not results[0] and not args.no_verify:  # the defaults, fresh, at the winner's rate: do they miss?
        record["head_to_head"] = _served_at(args, tokenizer, prompts, objectives, best.best_point.rate, logs,
                                            serve_command(args.model, start, args.serve_args.split()), "defaults")
        if record["head_to_head"]["met"]:
            defaults_goodput = max(defaults_goodput, record["head_to_head"]["goodput"])
    record.update(best=best.candidate.config(), best_goodput=best.goodput, defaults_goodput=defaults_goodput,
                  goodput_ratio=best.goodput / defaults_goodput if defaults_goodput else math.inf)
    write_config_file(args.output, {"model": args.model, **best.candidate.config()},
                      report.config_comment(args, best, defaults_goodput, objectives))
    if not args.no_verify:
        command = config_command(args.output, args.serve_args)
        record["verification"] = _served_at(args, tokenizer, prompts, objectives, best.best_point.rate, logs,
                                            command, "verify")
    _write(args, record, results, objectives)
    print(report.summary(record))
    return 0 if record.get("verification", {}).get("met", True) else 1


def _served_at(args: argparse.Namespace, tokenizer, prompts: RunPrompts, objectives, rate: float, logs: Path,
               command: list[str], label: str) -> dict:
    """A fresh server started with `command`, sent the runs' prompts at `rate`: the winner from its config
    file (does the SLO hold again?), and the defaults (do they miss where the winner met?)."""
    with served(command, logs / f"{label}.log") as url:
        measure_at(url, args, tokenizer, prompts.warm_up, math.inf, objectives, label)
        point, result = measure_at(url, args, tokenizer, prompts.run(0), rate, objectives, label)
    return {"command": " ".join(command[2:]), "rate": rate if math.isfinite(rate) else "inf", "met": point.check.met,
            "throughput": point.throughput, "goodput": point.check.goodput, "slo_values_ms": point.check.values_ms,
            "worst_ratio": point.check.worst_ratio, "p99_ttft_ms": result["p99_ttft_ms"],
            "p99_tpot_ms": result["p99_tpot_ms"]}


def _write(args: argparse.Namespace, record: dict, results, objectives) -> None:
    (args.result_dir / "tune.json").write_text(json.dumps(record, indent=1, default=str))
    report.plot(results, objectives, args.result_dir / "tune-frontier.png")

