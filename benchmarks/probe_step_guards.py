# ruff: noqa: E501  (a probe: deleted once its finding is in NOTES)
"""The Dynamo guards of bench_generate's compiled decode step, timed and attributed to sources.

Runs ``bench_generate.py`` with its own arguments (``--step`` paths); at the third compiled call of each path it finds
the compiled entry whose guards pass on that call's arguments, times ``guard_manager.check`` on them (best of 15 ×
200), then times clones of the guard tree without the managers under each source pattern below
(``RootGuardManager.clone_manager``; compare clone with clone: a clone checks slower than the original), and writes
the tree and the transformed bytecode under ``--out``.

    python benchmarks/probe_step_guards.py --model qwen3moe --layers 16 --fp8 --paths static_backend,fp8_static_backend --batches 1 --step
"""
import dis
import os
import re
import sys
import time

import torch
import torch._dynamo.convert_frame as cf

sys.path.insert(0, os.path.dirname(__file__))
import bench_generate as bg  # noqa: E402

PATTERNS = {"forward objects": r"\['forward'\]", "self_attn": r"\['self_attn'\]", "mlp": r"\['mlp'\]",
            "layers": r"\['layers'\]", "_parameters": r"_parameters", "_buffers": r"_buffers",
            "past_key_values": r"past_key_values", "config": r"config", "experts": r"\['experts'\]",
            "q/k/v/o_proj": r"\['(q|k|v|o)_proj'\]", "gate (router)": r"\['gate'\]", "norms": r"norm'\]",
            "globals": r"\bG\["}


def best_us(root, loc, n=200, reps=15) -> float:
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            root.check(loc)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return min(runs)


def attribute(root, loc) -> None:
    print(f"  guard check {best_us(root, loc):.1f} us, its clone {best_us(root.clone_manager(lambda m: True), loc):.1f} us")
    for name, pat in PATTERNS.items():
        rx, dropped = re.compile(pat), [0]

        def keep(m, rx=rx, dropped=dropped):
            drop = bool(rx.search(m.get_source()))
            dropped[0] += drop
            return not drop
        clone = root.clone_manager(keep)
        print(f"  clone without {name:18s} {best_us(clone, loc):7.1f} us ({dropped[0]} managers dropped)")


def probe(label, model, a, k, out) -> None:
    fv = getattr(type(model).forward, "__closure__", None) or ()
    func = fv[0].cell_contents if fv else None  # transformers' wrapper closes over the forward it wraps
    loc = {"self": model, "args": a, "kwargs": k, "func": func}
    for ref in list(cf.input_codes.seen):
        code = ref()
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code) if code is not None else []
        for i, e in enumerate(entries):
            try:
                if not e.guard_manager.check(loc):
                    continue
            except Exception:  # a resume function's frame: other locals
                continue
            ahead = [best_us(x.guard_manager.root, loc, 50, 5) for x in entries[:i]]
            print(f"ENTRIES {label}: {code.co_name} has {len(entries)} compiled entries; this call passes entry {i}; "
                  f"the entries checked before it fail in {', '.join(f'{t:.1f}' for t in ahead) or '-'} us")
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", label.split(")")[-1].strip())
            text = str(e.guard_manager)
            print(f"GUARDS {label}: {text.count(chr(10))} lines, {len(list(dis.get_instructions(e.code)))} bytecode instructions")
            attribute(e.guard_manager.root, loc)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"guards_{tag}.txt"), "w") as f:
                f.write(text)
            return
    print(f"GUARDS {label}: no compiled entry passes on this call's arguments")


def time_step(label, model, gen, device, new_tokens, calls=20, profile=None, _orig=bg.time_step):
    compiled, seen = model._compiled_call, [0]

    def recording(*a, **k):
        seen[0] += 1
        if seen[0] == 3:  # the third decode step: before bench_generate's timed calls begin
            probe(label, model, a, k, os.environ.get("OUT", "bench_out"))
        return compiled(*a, **k)
    model._compiled_call = recording
    try:
        return _orig(label, model, gen, device, new_tokens, calls, profile)
    finally:
        model._compiled_call = compiled


if __name__ == "__main__":
    bg.time_step = time_step
    sys.exit(bg.main(sys.argv[1:]))
