"""Benchmark cases ``data`` and ``data_prepare`` of scripts/benchmark.py (its docstring says what each
measures); the measurements themselves run in fresh processes through scripts/benchmarks/data.py.
"""

from __future__ import annotations

import os
import shutil

from scripts.benchmarks.harness import Stat, interleave, ratio_stat


def case_data(b) -> None:
    """The ``data`` rows and results (``b``: scripts/benchmark.py's Bench)."""
    from scripts.benchmarks import data

    sizes = {"1e7": 10**7, "1e9": 10**9}
    if shutil.disk_usage(b.folder).free < 3 * 10**9:
        del sizes["1e9"]
        b.row("data", "10^9-token corpus", f"skipped: less than 3 GB free in {b.folder}")
    folders, out = {}, {"write_s": {}}
    for name, n in sizes.items():
        folders[name] = os.path.join(b.folder, f"synthetic_{name}")
        out["write_s"][name] = data.write_synthetic(folders[name], n)
        b.row("data", f"write a synthetic prepared corpus of {name} tokens", f"{out['write_s'][name]:.1f} s")
        checked = out.setdefault("verify", {})[name] = data.verify_once(folders[name])
        b.row("data", f"{name} tokens: one-time checksum verification (first start on a set; warm page cache)",
              f"{checked['seconds']:.2f} s for {checked['bytes'] / 1e9:.2f} GB = {checked['gb_per_s']:.2f} GB/s")
    spec = {"seq_len": b.seq_len, "local_batch_size": b.local_batch_size, "seconds": 1.0}
    runs_ = {f"{name}@{pos:g}": {**spec, "path": folder, "position": pos}
             for name, folder in folders.items() for pos in (0, 10**8)}
    runs_["raw@0"] = {**spec, "path": data.RAW_CORPUS, "position": 0}
    samples = interleave({k: (lambda v=v: [data.measure_in_fresh_process(v)]) for k, v in runs_.items()},
                         max(2, b.rounds // 2))
    out["samples"] = samples
    med = {k: {m: Stat.of([s[m] for s in v]).median for m in v[0]} for k, v in samples.items()}
    model = b.timed("data_model", 1, {}, independent=True)[0]["step_s"]
    model_rate = b.seq_len * b.local_batch_size / Stat.of(model).median
    out.update(medians=med, model_tokens_per_s=model_rate)
    for name in folders:
        at0, at8 = med[f"{name}@0"], med[f"{name}@1e+08"]
        b.row("data", f"{name} tokens: first batch at window 0 / at window 1e8",
              f"{at0['first_batch_s']:.3f} s / {at8['first_batch_s']:.3f} s")
        b.row("data", f"{name} tokens: RSS added by the loader (first batch)",
              f"{at0['rss_added_bytes'] / 2**20:.1f} MiB")
        loader_rate = at0["loader_tokens_per_s"]
        b.row("data", f"{name} tokens: loader tokens/s / debugmodel training tokens/s",
              f"{loader_rate:,.0f} / {model_rate:,.0f} = {loader_rate / model_rate:,.0f}x")
    raw = med["raw@0"]
    b.row("data", "before: raw train.jsonl (tokenized at start): first batch, RSS added",
          f"{raw['first_batch_s']:.3f} s, {raw['rss_added_bytes'] / 2**20:.1f} MiB")
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
    b.results["data"] = out


def case_data_prepare(b, repeats: int = 8) -> None:
    """The ``data_prepare`` rows and results: ``repeats`` copies of the bundled corpus, prepared with
    ``--num_proc`` 1 and 2 (``b``: scripts/benchmark.py's Bench)."""
    from scripts.benchmarks import data

    corpus = data.repeated_corpus(os.path.join(b.folder, "corpus.jsonl"), repeats)
    procs = (1, 2)
    specs = {n: {"kind": "prepare", "input": corpus, "output": os.path.join(b.folder, f"prepared_{n}"), "num_proc": n,
                 "env": {"HF_DATASETS_CACHE": os.path.join(b.folder, f"hf_cache_{n}")}} for n in procs}

    def sample(n: int) -> list[dict]:
        shutil.rmtree(specs[n]["env"]["HF_DATASETS_CACHE"], ignore_errors=True)  # convert the input each time
        return [data.measure_in_fresh_process(specs[n])]

    samples = interleave({n: (lambda n=n: sample(n)) for n in procs}, max(3, b.rounds // 2))
    seconds = {n: [s["seconds"] for s in samples[n]] for n in procs}
    for n in procs:
        cpu = (Stat.of([s["cpu_workers_s"] for s in samples[n]]).median,
               Stat.of([s["cpu_main_s"] for s in samples[n]]).median)
        b.row("data_prepare", f"prepare train.jsonl x{repeats}, --num_proc {n}: seconds (CPU s workers / main)",
              f"{Stat.of(seconds[n]).median:.1f} s ({cpu[0]:.1f} / {cpu[1]:.1f})")
    speedup = ratio_stat(seconds[1], seconds[2])
    b.row("data_prepare", "--num_proc 2 over 1: speed-up (time 1 / time 2)",
          f"{speedup.median:.3f}x  (p25-p75 {speedup.p25:.3f}-{speedup.p75:.3f}, n={speedup.n})")
    b.results["data_prepare"] = {"samples": samples}
