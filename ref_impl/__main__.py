"""Command line: python -m ref_impl generate|chat|inspect|quantize|train|bench.

    python -m ref_impl generate --model models/stdlib-10m.gguf --prompt "def "
    python -m ref_impl generate --model ~/.ollama/models/blobs/sha256-... --chat --system "Be brief." --prompt "Hi"
    python -m ref_impl generate --model models/stdlib-10m.gguf --prompt-file long.py --prefill-chunk 256
    python -m ref_impl chat --model ~/.ollama/models/blobs/sha256-... --system "Be brief."
    python -m ref_impl inspect models/stdlib-10m.gguf
    python -m ref_impl quantize models/stdlib-10m.gguf /tmp/stdlib-10m-Q4_K_M.gguf --type Q4_K_M
    python -m ref_impl train --preset stdlib-10m --out models/
    python -m ref_impl train --mtp models/stdlib-10m.gguf --out models/
    python -m ref_impl bench --model models/stdlib-10m.gguf
    python -m ref_impl bench --roofs --label cpu-2core
    python -m ref_impl bench --quant-groups --label cpu-2core
    python -m ref_impl bench --link --label h200
    python -m ref_impl bench --unified --label h200
    python -m ref_impl bench --kernels --shape Llama-3.1-8B --weights Q4_K F16 --label h200
    python -m ref_impl bench --dispatch --shapes tiny Llama-3.2-1B Llama-3.1-8B --label h200
    python -m ref_impl bench --kv --label h200
    python -m ref_impl bench --spec --label h200
    python -m ref_impl bench --capstone --label cpu-2core
    python -m ref_impl generate --model models/stdlib-10m.gguf --prompt "def " --pipeline 2
    python -m ref_impl bench --pipeline --label cpu-2core
    python -m ref_impl bench --oracle --label cpu-2core
    python -m ref_impl bench --long --label cpu-2core
    python -m ref_impl bench --moe --label cpu-2core
    python -m ref_impl bench --window --label cpu-2core

Bad input (a missing or malformed file, an impossible setting) prints one line on stderr
and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

from ref_impl.formats import gguf
from ref_impl.formats.quantize import FILE_TYPES, quantize_file


def sampler_techniques(a: argparse.Namespace, speculate: str | None = None, stages: int = 1):
    """The Sampler and the Techniques of generate's and chat's flags (each refuses what cannot run)."""
    from ref_impl.engine.compose import Techniques
    from ref_impl.engine.generate import PREFILL_CHUNK, Sampler

    sampler = Sampler(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    techniques = Techniques(kv=a.kv, fused=a.kv_fused, speculate=speculate, gamma=getattr(a, "gamma", 4),
                            pipeline=not a.sync, compiled=a.compile, stages=stages,
                            prefill_chunk=PREFILL_CHUNK if a.prefill_chunk is None else a.prefill_chunk)
    return sampler, techniques


def load_options(a: argparse.Namespace, techniques):
    """The load-time switches of generate's and chat's flags (kernels/loading.py)."""
    from ref_impl.kernels.loading import LoadOptions

    if a.kernels == "on" and techniques.stages > 1:
        raise ValueError("--kernels on patches the model of one process; the --pipeline stages run MLX's own "
                         "operations")
    # a verification forwards gamma+1 rows: the kernels are chosen for those too when speculating
    rows = (1, techniques.gamma + 1) if techniques.speculate else (1,)
    return LoadOptions(weights=a.weights, kernels=a.kernels, dtype=a.dtype, rows=rows, compiled=techniques.compiled,
                       activations=a.activations)


def read_prompt(a: argparse.Namespace) -> str:
    """--prompt, or the text of --prompt-file (- : standard input)."""
    if a.prompt is not None:
        return a.prompt
    if a.prompt_file == "-":
        return sys.stdin.read()
    path = Path(a.prompt_file)
    if not path.is_file():
        raise ValueError(f"--prompt-file {path}: no such file")
    return path.read_text(encoding="utf-8")


def cmd_generate(a: argparse.Namespace) -> None:
    from ref_impl.engine import chat
    from ref_impl.engine.compose import check_files, generate
    from ref_impl.engine.mtp import load_heads
    from ref_impl.kernels.loading import LoadOptions, load

    # every refusal before any weight is read: the switches alone, then the files' metadata
    if a.draft and a.mtp:
        raise ValueError("--draft and --mtp are two proposers for one verification: choose one")
    if a.system is not None and not a.chat:
        raise ValueError("--system sets the system message of a chat: add --chat (the file's chat template "
                         "then lays out the system message and the --prompt)")
    sampler, techniques = sampler_techniques(a, "draft" if a.draft else "mtp" if a.mtp else None, a.pipeline)
    options = load_options(a, techniques)
    prompt = read_prompt(a)
    with gguf.read(a.model) as f:                   # opened once: metadata checks, then the weights
        check_files(f.metadata, a.model, a.draft, a.mtp)
        text = chat.chat_prompt(f.metadata, a.model, prompt, a.system) if a.chat else prompt
        if techniques.stages > 1:
            return generate_pipeline(a, text, options.quantized, techniques.prefill_chunk)
        loaded = load(f, options)
    model, tokenizer = loaded.model, loaded.tokenizer
    if a.draft:
        with gguf.read(a.draft) as f:
            proposer = load(f, LoadOptions(a.weights, "off", a.dtype), tokenizer=False).model
    else:
        proposer = load_heads(a.mtp, model, model.norm.weight.dtype) if a.mtp else None
    for line in loaded.report:
        print(line, file=sys.stderr)
    if not a.chat:  # a continuation is shown after its prompt; a chat shows the reply alone
        sys.stdout.write(prompt)
    g = generate(model, tokenizer, chat.encode(tokenizer, text) if a.chat else prompt, a.max_tokens, sampler,
                 techniques, proposer, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    print(flush=True)
    print(f"{loaded.describe()}, {g.summary()}", file=sys.stderr)


def generate_pipeline(a: argparse.Namespace, prompt: str, quantized: bool, chunk: int) -> None:
    """generate --pipeline N: the layers split over N processes on this host (engine/pipeline.py), which
    talk through mx.distributed's ring backend over loopback TCP; the same text, and one summary line."""
    from ref_impl.engine import pipeline
    from ref_impl.engine.checkpoint import weight_types

    config = pipeline.PipelineConfig(a.model, a.pipeline, prompt, a.max_tokens, a.temp, a.top_k, a.top_p, a.seed,
                                     a.kv, a.kv_fused, "native" if quantized else "float", a.dtype, a.chat,
                                     port=a.pipeline_port, timeout_s=a.pipeline_timeout, prefill_chunk=chunk)
    pipeline.check(config)           # more stages than layers, a port in use: refused before the prompt shows
    if not a.chat:
        sys.stdout.write(prompt)
    run = pipeline.generate(config, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    print(flush=True)
    stages = ", ".join(f"{s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(run.spans))
    print(f"weights {weight_types(a.model)} as {run.held}, kernels off, stages {stages} "
          f"({run.link_bytes_per_token()} link bytes per token); {run.summary}", file=sys.stderr)


CHAT_HELP = "/reset: start over; /system TEXT: set the system message; /exit (or Ctrl-D): quit; Ctrl-C: stop an answer"


def cmd_chat(a: argparse.Namespace) -> None:
    from ref_impl.engine.chat import chat_template
    from ref_impl.engine.conversation import Conversation
    from ref_impl.kernels.loading import load

    sampler, techniques = sampler_techniques(a)
    options = load_options(a, techniques)
    with gguf.read(a.model) as f:                   # opened once: the template checked, then the weights
        chat_template(f.metadata, a.model)
        loaded = load(f, options)
    for line in loaded.report:
        print(line, file=sys.stderr)
    conv = Conversation(loaded.model, loaded.tokenizer, loaded.metadata, a.model, techniques, sampler, a.max_tokens,
                        a.context, a.system)
    print(f"{loaded.describe()}; context {conv.context} positions, {techniques.describe()}\n{CHAT_HELP}",
          file=sys.stderr)
    converse(conv, sys.stdin.isatty())


def converse(conv, interactive: bool) -> None:
    """The chat loop: a line in, the answer streamed out, the turn's summary on stderr; commands start with /."""
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        except KeyboardInterrupt:                   # at the prompt: a fresh line, as a shell does
            print(file=sys.stderr)
            continue
        command, _, rest = line.strip().partition(" ")
        if command == "/exit":
            return
        if command == "/reset":
            conv.reset()
            print("(conversation reset)", file=sys.stderr)
        elif command == "/system":
            conv.system = rest.strip() or None
            print(f"(system message {'set' if conv.system else 'removed'}; the turns so far are kept)", file=sys.stderr)
        elif command.startswith("/"):
            print(f"unknown command {command}: {CHAT_HELP}", file=sys.stderr)
        elif line.strip():
            try:
                reply = conv.say(line, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
            except ValueError as e:                 # a message too long for the context: refused, one line
                print(" ".join(str(e).split()), file=sys.stderr)
                continue
            print(flush=True)
            for note in (reply.notice, "(stopped)" if reply.interrupted else "", reply.generation.summary()):
                if note:
                    print(note, file=sys.stderr)


def cmd_inspect(a: argparse.Namespace) -> None:
    from ref_impl.engine.chat import TEMPLATE_KEY
    from ref_impl.engine.runnable import why_not

    with gguf.read(a.path) as f:
        print(f"GGUF v{f.version}: {len(f.metadata)} metadata keys, {len(f.tensors)} tensors, "
              f"alignment {f.alignment}, data at offset {f.data_offset}")
        kw = max((len(k) for k in f.metadata), default=0)
        for key, value in f.metadata.items():
            text = repr(value)
            if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
                head = ", ".join(repr(v) for v in list(value[:4]))
                text = f"[{head}{', ...' if len(value) > 4 else ''}] ({len(value)} items)"
            print(f"  {key:<{kw}}  {f.metadata_types[key].name:<7}  {text[:100]}")
        rows = [(t.name, t.type.name, str(t.shape), str(t.offset), str(t.nbytes))
                for t in f.tensors.values()]
        head = ("tensor", "type", "shape", "offset", "bytes")
        w = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
        print()
        for r in [head, *rows]:
            print(f"  {r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]:>{w[3]}}  {r[4]:>{w[4]}}")
        total = sum(t.nbytes for t in f.tensors.values())
        print(f"\n  {len(f.tensors)} tensors, {total / 1e6:.2f} MB of tensor data")
        if a.mlx:
            from ref_impl.engine.transcode import plan

            print("\n  in MLX (python -m ref_impl generate --weights native):")
            rows = [(p.name, p.ggml_type, p.representation, f"{p.bits_per_weight():.2f}" if p.bits else "-", p.reason)
                    for p in plan(f).values()]
            w = [max(len(r[i]) for r in rows) for i in range(4)]
            for r in rows:
                print(f"  {r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]:>{w[3]}} bits  {r[4]}")
        print(f"\n  chat template: {'yes (generate --chat)' if f.metadata.get(TEMPLATE_KEY) else 'none'}")
        reason = why_not(f)
        print(f"  runs here: {'yes' if reason is None else 'no: ' + ' '.join(reason.split())}")


def cmd_quantize(a: argparse.Namespace) -> None:
    from collections import Counter

    types = quantize_file(a.input, a.output, a.type)
    with gguf.read(a.input) as src, gguf.read(a.output) as dst:
        before = sum(t.nbytes for t in src.tensors.values())
        after = sum(t.nbytes for t in dst.tensors.values())
        weights = sum(int(np.prod(t.shape)) for t in dst.tensors.values())
    mix = ", ".join(f"{n} {t}" for t, n in Counter(types.values()).most_common())
    print(f"wrote {a.output}: {a.type} ({mix} tensors); tensor data {before / 1e6:.2f} MB -> "
          f"{after / 1e6:.2f} MB, {8 * after / weights:.2f} bits per weight")


def cmd_train(a: argparse.Namespace) -> None:
    from ref_impl.training.models import config_for, train

    if bool(a.stdlib) != bool(a.corpus_python):
        raise ValueError("--stdlib and --corpus-python go together (the log records the corpus's version)")
    if a.mtp:  # MTP heads on a frozen model (mtp.py); the corpus and its split are the model's
        from ref_impl.training.heads import MTPConfig, train_heads

        given = {"steps": a.steps, "seed": a.seed, "stdlib": a.stdlib, "corpus_python": a.corpus_python}
        log = train_heads(MTPConfig(base=a.mtp, **{k: v for k, v in given.items() if v is not None}),
                          Path(a.out), progress=not a.quiet)
        accuracy = ", ".join(f"{e['accuracy']:.3f}" for e in log["heldout"][1:])
        print(f"wrote {Path(a.out) / log['heads']['file']}: {log['heads']['k']} heads, held-out top-1 accuracy "
              f"per head {accuracy}, {log['seconds']['total']:.0f} s")
        return
    cfg = config_for(a.preset, steps=a.steps, seed=a.seed, stdlib=a.stdlib, corpus_python=a.corpus_python)
    log = train(cfg, Path(a.out), progress=not a.quiet)
    print(f"wrote {Path(a.out) / log['model']['file']}: {log['model']['parameters'] / 1e6:.2f}M parameters, "
          f"held-out perplexity {log['heldout_perplexity']:.2f}, {log['seconds']['total']:.0f} s")


def cmd_bench(a: argparse.Namespace) -> None:
    import tempfile

    from ref_impl.measure.records import write_results
    from ref_impl.measure.suites import SUITES, chosen

    suite = SUITES[chosen(a)]
    with tempfile.TemporaryDirectory(dir=a.work_dir) as work:
        records = suite.run(a, Path(work), lambda msg: print(msg, file=sys.stderr, flush=True))
    path = write_results(records, Path(a.out), "python -m ref_impl " + shlex.join(sys.argv[1:]), a.label)
    for line in suite.show(records):
        print(line)
    print(f"wrote {path}")


# bench suites switched on by a flag alone (measure/suites.py runs each): flag -> help
SWITCHES = {
    "--kernel-profile": "CUDA: CUPTI kernel times of decode per fused launch",
    "--layer-launches": "CUDA: the fused kernels queued, per launch setting",
    "--gemv-decode": "CUDA: the 4-bit GEMV inner loop 5 ways, GB/s, error",
    "--ncu": "CUDA: Nsight Compute counters and stalls of the fused kernels",
    "--long": "long prompts and long answers: TTFT, prefill tok/s and peak memory at prompts of 512, 2,048 and 8,192 "
              "tokens (a random model with Llama 3's vocabulary, and --model where its context allows), ours chunked "
              "and in one pass, mlx-lm and llama.cpp; the prefill chunk swept; ITL early vs late over 4,000 tokens",
    "--moe": "mixture of experts on the roofline: a random qwen3moe file against dense qwen3 files of the same total "
             "and the same active bytes (F32 on a CPU, Q8_0 on a GPU): bytes per token, decode tok/s and the bandwidth "
             "they imply, ours and llama.cpp",
    "--oracle": "the pages' comparisons with llama.cpp (needs llama-cpp-python): --model's Q4_K_M tensors and logits "
                "against llama.cpp's, and a Qwen2-style random file's tokens and first greedy tokens; times nothing",
    "--window": "the KV cache of a sliding window: Gemma-3-12B's caches as the decoder builds them (unallocated) at "
                "1k-128k positions, with its window and all layers global, against theory; a tiny random gemma3 "
                "decoded at 256-16k positions with its window and without: tok/s, cache bytes",
}


def add_bench(sub) -> None:
    """The bench command's flags: each suite's switch (measure/suites.py) and its sizes."""
    b = sub.add_parser("bench", help="measure decode speed (and peers) and write results/*.json")
    b.add_argument("--model", default="models/stdlib-10m.gguf")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--gen-tokens", type=int, default=128)
    b.add_argument("--long-context", type=int, default=4096,
                   help="bench --capstone: the long-context case's prompt in tokens (0: leave the case out)")
    b.add_argument("--long-only", action="store_true", help="bench --capstone: the long-context case alone")
    b.add_argument("--ppl-only", action="store_true", help="bench --capstone: perplexities alone (timing nothing)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-peers", action="store_true", help="skip mlx-lm and llama.cpp")
    b.add_argument("--quant", nargs="+", metavar="TYPE", choices=list(FILE_TYPES),
                   help="quantize --model to each llama.cpp file type: size, perplexity, decode speed")
    b.add_argument("--quant-groups", action="store_true",
                   help="held-out perplexity of --model with one group of matrices (attention, MLP, embedding) "
                        "rounded through Q4_K at a time")
    b.add_argument("--ppl-tokens", type=int, default=None,
                   help="held-out tokens for --quant, --quant-groups and --capstone's perplexity, a sample spread "
                        "over the text (default: all, the book's perplexity; 0: skip --quant's and --capstone's)")
    b.add_argument("--shape", help="decode a random-weight model of this public shape, e.g. Llama-3.1-8B")
    b.add_argument("--weights", nargs="+", default=["F16", "Q4_K"],
                   help="weight types for --shape; the fused-layer probes take F16 and Q4_K (their 4-bit mix)")
    b.add_argument("--roofs", action="store_true",
                   help="this machine's roofs alone: memory probes (MLX copy and read; numpy's copy on a CPU) and the "
                        "matmul peak; --model, --shape, --kernels and --capstone record them too")
    b.add_argument("--roof-bytes", type=int, default=1 << 30, help="the array the memory probes copy and read (bytes)")
    b.add_argument("--link", action="store_true", help="copy bandwidth: host memory, host<->device through PyTorch")
    b.add_argument("--link-budget", type=float, default=60.0, help="seconds --link may spend on device copies")
    b.add_argument("--link-max-bytes", type=int, default=1 << 30, help="largest transfer --link times (bytes)")
    b.add_argument("--kernels", action="store_true",
                   help="custom CUDA GEMV kernels vs MLX's built-ins: GB/s per matrix of --shape (default "
                        "Llama-3.1-8B), decode tok/s per --weights type with and without them; needs CUDA")
    for flag, text in SWITCHES.items():
        b.add_argument(flag, action="store_true", help=text)
    b.add_argument("--llama-bench", metavar="PATH",
                   help="for --kernels and --capstone: llama.cpp's llama-bench binary, run on the same GGUF files as "
                        "the peer")
    b.add_argument("--unified", action="store_true",
                   help="numpy <-> MLX conversions (copy or share, time vs size) and first reads of fresh arrays")
    b.add_argument("--unified-max-bytes", type=int, default=256 << 20, help="largest array --unified times (bytes)")
    b.add_argument("--alignment", action="store_true",
                   help="the GGUF chapter's misaligned-read sweep: GEMV and sum read rates at byte offsets 0-64, "
                        "in L2 and from DRAM, numpy and MLX")
    b.add_argument("--alignment-budget", type=float, default=60.0, help="seconds --alignment may take")
    b.add_argument("--dispatch", action="store_true",
                   help="dispatch measurements (sync vs async_eval vs eval per layer, first-call cost, kernel "
                        "latency, KV-cache jitter, wired memory, TTFT/ITL vs context) on --model and --shapes")
    b.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="random-weight shapes for --dispatch: tiny or a Llama shape (default: tiny, Llama-3.2-1B, "
                        "Llama-3.1-8B on a GPU; tiny on the CPU); for --kv: stdlib-10m (--model) or a Llama shape "
                        "(default: stdlib-10m, Llama-3.2-1B, Llama-3.1-8B on a GPU; stdlib-10m on the CPU); for "
                        "--pipeline: beside --model (default: Llama-3.2-1B)")
    b.add_argument("--kv", action="store_true",
                   help="KV-cache quantization: held-out perplexity and needle retrieval per scheme on --model, "
                        "bytes per token, decode tok/s vs context (dequantized and fused attention) on --shapes")
    b.add_argument("--spec", action="store_true",
                   help="speculative decoding: acceptance on held-out text, forward time vs positions, speedup for "
                        "gamma 1..8 of --model with --draft, its MTP heads and random pairs with alpha set")
    b.add_argument("--capstone", action="store_true",
                   help="the composed decoder's switches one at a time and together (an ablation ladder), mlx-lm and "
                        "llama.cpp on the same weights, a long-context case, perplexity per weights and cache; on "
                        "--model with --draft and its MTP heads, or on random weights of --shape")
    b.add_argument("--pipeline", action="store_true",
                   help="pipeline-parallel decoding over mx.distributed on this host: each token's time split into "
                        "compute and link, bytes per token on the link, per --pipeline-stages, for --model and "
                        "random weights of --shapes (default Llama-3.2-1B)")
    b.add_argument("--pipeline-stages", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                   help="stage counts for --pipeline")
    b.add_argument("--draft", default="models/stdlib-draft-1m.gguf", help="the draft model for --spec and --capstone")
    b.add_argument("--mtp-heads", help="MTP heads for --spec and --capstone (default: MODEL-mtp.gguf beside --model, "
                                       "if present)")
    b.add_argument("--quick", action="store_true",
                   help="--dispatch, --spec, --kv, --capstone, --long, --moe or --window with tiny sizes: checks it "
                        "runs, in seconds; "
                        "--kernels: decode only, default launches (no per-matrix sweep or timing)")
    b.add_argument("--work-dir", help="where --quant and --shape write their temporary GGUF files")
    b.add_argument("--label", help="machine label for the file name (default: host-backend)")
    b.add_argument("--out", default="results")
    b.set_defaults(run=cmd_bench)


def add_decoder(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The flags generate and chat share: the file, sampling, how weights are held, the cache, the loop."""
    p.add_argument("--model", required=True,
                   help="a GGUF file of an architecture this decoder reads (inspect FILE says), whatever its name "
                        "(an Ollama blob has no extension)")
    p.add_argument("--system", metavar="TEXT", help="the system message of a chat (generate: with --chat)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per answer at most")
    p.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float32 on CPU, float16 on GPU")
    p.add_argument("--sync", action="store_true", help="wait for each token (no async_eval pipelining)")
    p.add_argument("--weights", choices=["auto", "native", "float"], default="auto",
                   help="quantized tensors as MLX quantized matrices (native) or expanded to floats; "
                        "auto: native on a GPU, float on the CPU")
    p.add_argument("--kernels", choices=["auto", "on", "off"], default="auto",
                   help="our CUDA kernels (ref_impl/kernels/: GEMVs, and whole decoder layers fused) where a "
                        "measurement at load finds them faster than MLX's built-ins; auto: on MLX's CUDA backend "
                        "only; on: fail elsewhere")
    p.add_argument("--activations", choices=["float", "int8"], default="float",
                   help="int8: the fused layers' quantized matrices but the down projection meet int8 copies of "
                        "their inputs, rounded per 32 values as llama.cpp's q8_1 (fewer GPU instructions a weight, one "
                        "more rounding); CUDA only")
    p.add_argument("--compile", action="store_true",
                   help="trace one decode step with mx.compile and replay it at every position (less host time "
                        "per token where the host limits decode)")
    p.add_argument("--kv", default="float", metavar="SCHEME",
                   help="the KV cache: float, or a quantized scheme (sym8, sym4, affine8, affine4-g32, kivi4, "
                        "outlier4, ...: the KV-cache chapter's)")
    p.add_argument("--kv-fused", action="store_true",
                   help="attention straight on the cache's codes (affine and outlier schemes), not a dequantized copy")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt positions per prefill pass: peak memory beyond the weights and cache stays that of "
                        "N positions, however long the prompt (default: engine/generate.py's PREFILL_CHUNK, 512)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ref_impl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt with a GGUF model")
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the text to continue; with --chat, the user's message")
    text.add_argument("--prompt-file", metavar="PATH", help="the prompt's text from a file (- : standard input)")
    g.add_argument("--chat", action="store_true",
                   help="lay the prompt out with the file's chat template (tokenizer.chat_template) and reply")
    add_decoder(g, max_tokens=128)
    g.add_argument("--draft", metavar="MODEL.gguf",
                   help="speculative decoding: a small model with the same vocabulary proposes, this one verifies")
    g.add_argument("--mtp", metavar="HEADS.gguf",
                   help="self-speculative decoding: multi-token-prediction heads trained on this model propose")
    g.add_argument("--gamma", type=int, default=4, help="drafts proposed per verification (--draft or --mtp)")
    g.add_argument("--pipeline", type=int, default=1, metavar="N",
                   help="split the layers over N processes on this host that pass the hidden state through "
                        "mx.distributed's ring backend (loopback TCP); 1: one process")
    g.add_argument("--pipeline-port", type=int, default=0, metavar="PORT",
                   help="with --pipeline: stage s listens on PORT + s (default: free ports)")
    g.add_argument("--pipeline-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --pipeline: stop every stage when none has printed anything for this long")
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser("chat", help="a conversation in the terminal with a chat model's GGUF file (KV cache kept "
                                    "between turns)")
    add_decoder(c, max_tokens=512)
    c.add_argument("--context", type=int, metavar="N",
                   help="positions the conversation's cache holds (default: 4,096, or the model's context if shorter)")
    c.set_defaults(run=cmd_chat)

    i = sub.add_parser("inspect", help="print a GGUF file's metadata and tensor table, and whether it runs here")
    i.add_argument("path")
    i.add_argument("--mlx", action="store_true", help="also show how each tensor is held in MLX")
    i.set_defaults(run=cmd_inspect)

    q = sub.add_parser("quantize", help="quantize a float GGUF model as llama.cpp's llama-quantize does")
    q.add_argument("input", help="an F32, F16 or BF16 llama GGUF file")
    q.add_argument("output")
    q.add_argument("--type", default="Q4_K_M", choices=list(FILE_TYPES),
                   help="a llama.cpp file type; Q4_K is every matrix Q4_K (llama.cpp's --pure Q4_K_S)")
    q.set_defaults(run=cmd_quantize)

    t = sub.add_parser("train", help="train the tokenizer and a model on the standard library")
    t.add_argument("--preset", default="stdlib-10m")
    t.add_argument("--out", default="models")
    t.add_argument("--steps", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--stdlib", help="train on another Python's Lib/ directory (default: this Python's)")
    t.add_argument("--corpus-python", help="the version of the Python whose Lib/ --stdlib names")
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--mtp", metavar="MODEL", help="train multi-token-prediction heads on this frozen GGUF model "
                                                  "instead (writes <name>-mtp.gguf; --preset is ignored)")
    t.set_defaults(run=cmd_train)

    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        a.run(a)
    except (ValueError, OSError, RuntimeError, KeyError) as e:  # gguf.GGUFError is a ValueError
        message = f"missing {e}" if type(e) is KeyError else str(e) or type(e).__name__
        print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the message
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
