"""`bench report`: the headline tables of docs/benchmarks.md from `bench compare` result files."""

from __future__ import annotations

import json

from llmaccel.bench.headline import BEGIN, END
from llmaccel.cli import main

ZEN3 = {"cpu": "AMD EPYC", "cpu_family_model": "25/1", "cores": 2, "features": ["avx2", "fma"]}
XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "features": ["avx2", "fma", "avx512f", "avx512_bf16",
                                                                       "amx_tile"]}


def system(label: str, rates: list[float], burst: float, rss_gib: float, start: float, paired_with: list[str]) -> dict:
    return {"label": label, "paired_with": paired_with, "start_seconds": start, "peak_rss_bytes": rss_gib * 2**30,
            "single": {"request_output_throughput": rates, "output_throughput": sum(rates) / len(rates),
                       "completed": len(rates), "total_output_tokens": 128 * len(rates)},
            "concurrent": {"output_throughput": burst, "completed": 64, "total_output_tokens": 64 * 64}}


def write(path, machine: dict, systems: list[dict], **extra) -> str:
    path.write_text(json.dumps({"model": "/root/shapes/llama-3b-Q8_0.gguf", "machine": machine,
                                "systems": systems, **extra}))
    return str(path)


def test_report_groups_tables_by_machine_kind_with_side_by_side_ratios(tmp_path, capsys):
    zen3 = write(tmp_path / "3b-zen3.json", ZEN3, [
        system("llmaccel-Q8_0", [8.0, 9.0, 10.0], 21.2, 3.61, 11.7, ["llama.cpp-Q8_0"]),
        system("llama.cpp-Q8_0", [6.0, 6.0, 8.0], 13.1, 4.74, 2.7, ["llmaccel-Q8_0"]),
        {"label": "openvino-int8", "failed_to_start": "did not come up"},
    ], date="2026-12-05T07:00Z", commit="abc1234")
    xeon = write(tmp_path / "xeon.json", XEON, [system("llmaccel", [30.0], 800.0, 1.5, 9.0, [])],
                 date="2026-12-02T10:00Z", commit="def5678+changes")
    assert main(["bench", "report", zen3, xeon]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:5] == [  # the answer first: llmaccel's best against the best peer, per kind and model
        "| machine | model | W1 tok/s, llmaccel's best over the best peer's | the best peer's | W2 tok/s, "
        "llmaccel's best over the best peer's | the best peer's |",
        "|---|---|---|---|---|---|",
        "| AMD EPYC Zen 3, AVX2, 2 cores | llama-3b | **1.50x**: 9 (Q8_0) | 6 (llama.cpp-Q8_0) | "
        "**1.62x**: 21.2 (Q8_0) | 13.1 (llama.cpp-Q8_0) |",
        "| Intel(R) Xeon(R) Processor, AMX, 2 cores | llama-3b | 30 (default) | no peer | 800 (default) | no peer |",
        "",
    ]
    assert out.splitlines()[5:14] == [
        "### AMD EPYC Zen 3, AVX2, 2 cores",
        "",
        f"**llama-3b**: 2026-12-05T07:00Z, commit abc1234, [3b-zen3.json]({zen3})",
        "",
        "| server | W1 tok/s (3 x 128 tokens), median repeat | the first of its group over this, side by side "
        "| W2 tok/s (64 x 64 tokens) | peak RSS GiB | start s |",
        "|---|---:|---:|---:|---:|---:|",
        "| llmaccel-Q8_0 | 9 |  | 21.2 | 3.61 | 11.7 |",
        # round by round 8/6, 9/6, 10/8: the median is 1.33, not the ratio of the medians (9/6 = 1.5)
        "| llama.cpp-Q8_0 | 6 | 1.33x | 13.1 | 4.74 | 2.7 |",
        "| openvino-int8 | did not start | | | | |",
    ]
    assert "### Intel(R) Xeon(R) Processor, AMX, 2 cores" in out and "commit def5678+changes" in out


def test_update_rewrites_only_the_part_between_the_markers(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    result = write(tmp_path / "results" / "r.json", ZEN3, [system("llmaccel", [10.0], 50.0, 2.0, 5.0, [])],
                   date="2026-12-05T07:00Z", commit="abc1234")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{BEGIN}\nold table\n{END}\n\n## Details\n")
    assert main(["bench", "report", result, "--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# Benchmarks\n\nintro\n\n{BEGIN}\n| machine | model |")
    assert "\n\n### AMD EPYC Zen 3, AVX2, 2 cores\n" in text
    assert text.endswith(f"{END}\n\n## Details\n")
    assert "old table" not in text and "[r.json](results/r.json)" in text  # linked from the doc's folder
    assert main(["bench", "report", result, "--update", str(doc)]) == 0
    assert doc.read_text() == text  # regenerating changes nothing


def test_tables_into_keeps_the_doc_to_the_answer_and_links_the_rest(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "more").mkdir()
    result = write(tmp_path / "results" / "r.json", ZEN3, [system("llmaccel", [10.0], 50.0, 2.0, 5.0, [])],
                   date="2026-12-05T07:00Z", commit="abc1234")
    doc, tables = tmp_path / "benchmarks.md", tmp_path / "more" / "peers.md"
    doc.write_text(f"# Benchmarks\n\n{BEGIN}\nold\n{END}\n")
    tables.write_text(f"# Every run\n\n{BEGIN}\nold\n{END}\n")
    assert main(["bench", "report", result, "--update", str(doc), "--tables-into", str(tables)]) == 0
    assert doc.read_text() == (f"# Benchmarks\n\n{BEGIN}\n"
                               "| machine | model | W1 tok/s, llmaccel's best over the best peer's | the best peer's "
                               "| W2 tok/s, llmaccel's best over the best peer's | the best peer's |\n"
                               "|---|---|---|---|---|---|\n"
                               "| AMD EPYC Zen 3, AVX2, 2 cores | llama-3b | 10 (default) | no peer | 50 (default) "
                               "| no peer |\n\n"
                               f"Every server of each run: [more/peers.md](more/peers.md).\n{END}\n")
    text = tables.read_text()
    assert text.startswith(f"# Every run\n\n{BEGIN}\n### AMD EPYC Zen 3, AVX2, 2 cores\n")
    assert "[r.json](../results/r.json)" in text and "| llmaccel | 10 |  | 50 | 2 | 5 |" in text
    assert main(["bench", "report", result, "--tables-into", str(tables)]) == 2
    assert "--tables-into FILE2 goes with --update FILE" in capsys.readouterr().err


def test_report_names_what_is_wrong(tmp_path, capsys):
    doc = tmp_path / "plain.md"
    doc.write_text("# no markers\n")
    result = write(tmp_path / "r.json", ZEN3, [system("llmaccel", [10.0], 50.0, 2.0, 5.0, [])])
    assert main(["bench", "report", result, "--update", str(doc)]) == 2
    (tmp_path / "offline.json").write_text('{"results": []}')
    assert main(["bench", "report", str(tmp_path / "offline.json")]) == 2
    err = capsys.readouterr().err
    assert f"{doc}: needs one line" in err and "offline.json: not a `bench compare` result file" in err


def test_a_ratio_where_llmaccel_trails_is_not_bold(tmp_path, capsys):
    behind = write(tmp_path / "behind.json", ZEN3, [
        system("llmaccel-Q4_K_M", [16.0, 16.0, 17.0], 65.0, 3.2, 11.0, ["llama.cpp-Q4_K_M"]),
        system("llama.cpp-Q4_K_M", [17.5, 17.5, 18.0], 26.0, 4.9, 5.0, ["llmaccel-Q4_K_M"]),
    ])
    assert main(["bench", "report", behind]) == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        "| AMD EPYC Zen 3, AVX2, 2 cores | llama-3b | 0.91x: 16 (Q4_K_M) | 17.5 (llama.cpp-Q4_K_M) | "
        "**2.50x**: 65 (Q4_K_M) | 26 (llama.cpp-Q4_K_M) |")


def test_zen4_and_zen5_runs_are_kinds_of_their_own(tmp_path, capsys):
    """Both have AVX512-BF16 and VNNI: only the family/model tells them (and their speeds) apart."""
    features = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]
    zen4 = write(tmp_path / "zen4.json", {"cpu": "AMD EPYC", "cpu_family_model": "25/17", "cores": 2,
                                          "features": features}, [system("llmaccel", [10.0], 50.0, 2.0, 5.0, [])])
    zen5 = write(tmp_path / "zen5.json", {"cpu": "AMD EPYC", "cpu_family_model": "26/2", "cores": 2,
                                          "features": features}, [system("llmaccel", [12.0], 60.0, 2.0, 5.0, [])])
    unknown = write(tmp_path / "old.json", {"cpu": "AMD EPYC", "cores": 2, "features": features},
                    [system("llmaccel", [11.0], 55.0, 2.0, 5.0, [])])
    assert main(["bench", "report", zen4, zen5, unknown]) == 0
    rows = capsys.readouterr().out.splitlines()[2:5]
    assert [row.split(" | ")[0] for row in rows] == [
        "| AMD EPYC Zen 4, AVX512-BF16, 2 cores", "| AMD EPYC Zen 5, AVX512-BF16, 2 cores",
        "| AMD EPYC, AVX512-BF16, 2 cores"]
