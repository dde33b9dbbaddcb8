"""What every script trains and evaluates on: Countdown tasks (the generator's splits, JSONL files
and hub datasets, with a one-line error naming the embedded alternative when the hub cannot be
reached), the prompt templates, sft.py's examples (RLT's teacher and student formats among them),
ipo.py's solver pairs, and the probe's record of solve rates (common.probe)."""
import contextlib
import hashlib
import inspect
import json
import os
import random
import re
import socket

import verifier
from verifier import make_prompt
from plumbing.flags import CountdownError
from plumbing.traces import MISTAKES, arith_text, flip_operator, make_trace, parse_mix

QUESTION = re.compile(r"Using the numbers \[([\d, ]*)\], create an equation that equals (\d+)")


def match_prompts(queries, template, source, rebuild=False):
    """A dataset's SFT queries as the prompts the RL and evaluation scripts will build: each must be
    make_prompt(nums, target, template) of the numbers and target its question names, else one
    line naming the first that is not (the model would learn one prompt and be tested on another);
    with `rebuild`, each is rebuilt so, on purpose."""
    out = []
    for i, q in enumerate(queries, 1):
        m = QUESTION.search(q)
        if not m:
            raise CountdownError(f"{source}: query {i} names no numbers and target as the "
                                 "templates do")
        want = make_prompt([int(x) for x in m[1].split(",") if x.strip()], int(m[2]), template)
        if q != want and not rebuild:
            at = next((k for k, (a, b) in enumerate(zip(q, want)) if a != b),
                      min(len(q), len(want)))
            raise CountdownError(
                f"{source}: query {i} differs from the --template {template} prompt of its numbers "
                f"and target at character {at} ({q[at:at + 40]!r}); pass the --template it was "
                "written in, or --rebuild_prompts")
        out.append(want)
    return out


def read_jsonl(path, required=()):
    """Rows of a JSONL file; a malformed line or a missing field is an error naming file:line."""
    if not os.path.isfile(path):
        raise CountdownError(f"no such file: {path}")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CountdownError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            missing = [k for k in required if not isinstance(row, dict) or k not in row]
            if missing:
                has = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise CountdownError(f"{path}:{i}: missing field(s) {missing}; the line has {has}")
            rows.append(row)
    return rows


def write_jsonl(path, rows):
    """`rows` as JSON lines, written to path.tmp and renamed: a killed run never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


def file_split(rows, split, eval_problems):
    """A file has no splits: its last rows (up to 10 %, at most eval_problems) are held out."""
    k = min(eval_problems, len(rows) // 10)
    return rows[:len(rows) - k] if split == "train" else rows[len(rows) - k:]


def common_queries(paths, eval_problems):
    """The queries every JSONL file in `paths` trains on (its rows but the held-out tail)."""
    return set.intersection(*({r["query"] for r in file_split(read_jsonl(p, ["query"]), "train",
                                                             eval_problems)} for p in paths))


def only_problems(prompts, write, queries):
    """(prompts, rng -> responses) kept to the rows whose prompt is in `queries`: students of
    different sources on the same problems, each sample differing only in its trace (004 §4)."""
    keep = [i for i, p in enumerate(prompts) if p in queries]
    if not keep:
        raise CountdownError("--problems: no training problem of --data is in every file")
    return [prompts[i] for i in keep], lambda rng: (lambda out: [out[i] for i in keep])(write(rng))


def load_records(source, split, required):
    """Rows from a local .jsonl file, or a hub dataset's split (the `datasets` import is lazy)."""
    if source.endswith(".jsonl") or os.path.exists(source):
        return read_jsonl(source, required)
    hint = " The embedded alternative needs no hub: --data gen (see README)"
    check_hub(f"dataset '{source}'", hint)
    try:
        import datasets
        ds = datasets.load_dataset(source, split=split)
    # unknown name, no such split, no access: all end the same way for a user
    except Exception as e:
        raise CountdownError(f"could not load dataset '{source}' split '{split}' "
                             f"({type(e).__name__}: {e}).{hint}") from None
    missing = [k for k in required if k not in ds.column_names]
    if missing:
        raise CountdownError(
            f"dataset '{source}' has no column(s) {missing}; it has {ds.column_names}")
    return list(ds)


def check_hub(what, hint):
    """Fail in seconds, not after huggingface_hub's minute of retries (HF_HUB_OFFLINE=1: use the
    cache)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "false", ""):
        return
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        raise CountdownError(
            f"cannot reach {host} to fetch {what} (offline? if it is in your HF cache, "
            f"set HF_HUB_OFFLINE=1).{hint}") from None


GEN_DEFAULTS = {"nums": "3-4", "range": "1-99", "target": "10-100", "test": "500", "val": "200",
                "seed": "0"}
HUB_HELD_OUT = 1000  # Countdown-Tasks-3to4 has only a train split: its last rows are our val + test


def load_tasks(data, split, n=None):
    """Countdown tasks {"nums", "target"} of split train|val|test (first n) from one of:
    `gen[:key=value,...]`  the generator; keys nums=3-4 range=1-99 target=10-100 test=500 val=200
                           seed=0 (the seed belongs to the data, so every script sees one test set);
    `path.jsonl`           a file with nums/target per line (the file is the split);
    `owner/name`           a hub dataset: its train split minus the last 1,000 rows (500 val, 500
                           test)."""
    if split not in ("train", "val", "test"):
        raise CountdownError(f"unknown split '{split}': use train, val or test")
    if data == "gen" or data.startswith("gen:"):
        try:
            kv = dict(GEN_DEFAULTS, **dict(item.split("=") for item in data[4:].split(",") if item))
            assert set(kv) == set(GEN_DEFAULTS)
            span = {
                k: (int(kv[k].split("-")[0]), int(kv[k].split("-")[-1]))
                for k in ("nums", "range", "target")
            }
            sizes = {"test": int(kv["test"]), "val": int(kv["val"]), "train": n or 10_000}
        except (ValueError, AssertionError):
            raise CountdownError(
                f"bad --data '{data}': expected gen:key=value,... with keys {sorted(GEN_DEFAULTS)} "
                "and spans like nums=3-4 or nums=3") from None
        # don't generate what isn't asked
        sizes = dict(list(sizes.items())[: list(sizes).index(split) + 1])
        rows = generated(sizes, int(kv["seed"]), tuple(range(span["nums"][0], span["nums"][1] + 1)),
                         span["range"], span["target"])[split]
    else:
        rows = load_records(data, "train", ["nums", "target"])
        if not os.path.exists(data):  # a hub dataset: carve the held-out rows off its only split
            h = HUB_HELD_OUT
            rows = {"train": rows[:-h], "val": rows[-h:-h // 2], "test": rows[-h // 2:]}[split]
    for i, r in enumerate(rows, 1):
        if not (isinstance(r["nums"], list) and r["nums"] and
                all(type(x) is int for x in r["nums"]) and type(r["target"]) is int):
            raise CountdownError(f"{data} row {i}: nums must be a list of ints and target an int, "
                                 f"got {r['nums']!r}, {r['target']!r}")
    if not rows:
        raise CountdownError(f"no tasks in {data} ({split})")
    return [{"nums": list(r["nums"]), "target": r["target"]} for r in rows[:n]]


def generated(sizes, *args):
    """verifier.generate_splits(sizes, *args), its train split kept in a file: the generator stops
    only after 5,000 misses in a row, ~10 s in every stage for run_cpu.sh's small space (1.7M draws
    for 11,854 problems). Train fills last: a smaller one is a prefix of a larger one, and one that
    ran dry is all there is. The file's name hashes the other arguments and the generator's source
    (an edited one never reads an old file); it lives in $COUNTDOWN_CACHE (default
    ~/.cache/countdown-posttrain). Unreadable or unwritable: generated as before."""
    if "train" not in sizes:  # test and val fill first: a few hundred draws
        return verifier.generate_splits(sizes, *args)
    n, rest = sizes["train"], {k: v for k, v in sizes.items() if k != "train"}
    source = inspect.getsource(verifier.generate_splits) + inspect.getsource(verifier._solvable)
    key = hashlib.sha256(repr((rest, args, source)).encode()).hexdigest()[:16]
    path = os.path.join(os.environ.get("COUNTDOWN_CACHE") or os.path.expanduser(
        "~/.cache/countdown-posttrain"), f"tasks-{key}.json")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none yet, or broken
        with open(path) as f:
            kept = json.load(f)
        if n <= kept["train_asked"] or len(kept["splits"]["train"]) < kept["train_asked"]:
            return {**kept["splits"], "train": kept["splits"]["train"][:n]}  # a prefix, or all
    splits = verifier.generate_splits(sizes, *args)
    with contextlib.suppress(OSError):  # whole or not at all: stages side by side may write it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump({"train_asked": n, "splits": splits}, f)
        os.replace(f"{path}.{os.getpid()}", path)
    return splits


# ---- what sft.py and ipo.py train on ------------------------------------------------------------
# the unverified source's mistakes, the analog of LLM-written traces: 63 % wrong, 37 % correct
LLM_MISTAKES = "slip:0.25,reuse:0.15,giveup:0.15,malformed:0.08"


def parse_mixes(strategies, mistakes):
    """--strategies and --mistakes as traces.make_trace's `mix` and `mistakes`, or one line."""
    try:
        return parse_mix(strategies), parse_mix(mistakes, MISTAKES, rates=True)
    except ValueError as e:
        raise CountdownError(f"--strategies / --mistakes: {e}") from None


def sft_data(data, split, n, template, eval_problems, dead_ends=0.0, near_misses=0.0,
             fixed_traces=False, seed=0, mix=None, mistakes=None, verified=False, rebuild=False):
    """sft.py's examples: prompts and a function rng -> responses. Solver traces of generated
    problems (new ones each call: another solution path, other dead ends; each trace's strategy
    drawn from `mix`, its mistakes from `mistakes`), plain arithmetic over their numbers (no
    prompt: the whole text is the target, 4 random paths a row), or a dataset's fixed
    query/completion pairs. (RLT's teacher format, `rlt:`, is teacher_sft_data.)"""
    kind, _, spec = data.partition(":")
    if kind in ("gen", "arith"):
        tasks = load_tasks("gen:" + spec, split, n or 20_000)
        if kind == "arith":
            nums = [t["nums"] for t in tasks]
            return [""] * len(tasks), lambda rng: [arith_text(nums[i:i + 4], rng)
                                                   for i in range(len(nums))]
        def write(rng):  # with `verified`, 001's gate: a trace the scorer rejects becomes None
            out = [make_trace(t["nums"], t["target"], rng, dead_ends, near_misses, mix, mistakes)
                   for t in tasks]
            return [x if not verified or verifier.score(x, t["nums"], t["target"]) == 1.0 else None
                    for x, t in zip(out, tasks)]
        fixed = write(random.Random(seed)) if fixed_traces else None
        return [make_prompt(t["nums"], t["target"], template) for t in tasks
                ], lambda rng: fixed or write(rng)
    if verified:
        raise CountdownError("--verified gates generated traces (--data gen:...): a dataset's rows "
                             "are taken as they are")
    if os.path.exists(data):
        rows = file_split(load_records(data, "train", ["query", "completion"]), split,
                          eval_problems)
    else:
        rows = load_records(data, "train" if split == "train" else "test", ["query", "completion"])
    rows = rows[:n or None]  # queries: the prompts RL and evaluate.py build (data.match_prompts)
    return match_prompts([r["query"] for r in rows], template, data, rebuild), lambda rng: [
        r["completion"] for r in rows]


# ---- RLT's two prompt formats (004 Fig. 6-7, adapted), its teacher's warm-up ---------------------
def student_prompt(task, template):
    return make_prompt(task["nums"], task["target"], template)  # ends with "<think>"


def teacher_prompt(task, solution, template):
    """The student's prompt with the solution first in the assistant's turn; the explanation then
    opens <think> (004 Fig. 7: solution block, then the explanation block)."""
    prompt = student_prompt(task, template).removesuffix("<think>")
    return prompt + f"<answer>{solution}</answer>\n<think>"


def student_completion(explanation, solution):
    """The distillation target d_i: the teacher's think tokens, then the solution (004 §3.2)."""
    return f"{explanation}</think>\n<answer>{solution}</answer>"


def student_row(task, explanation, solution, template):
    """An exported explanation as sft.py's data: the student's prompt, e, then s (004 Fig. 3)."""
    return {"query": student_prompt(task, template), "nums": task["nums"], "target": task["target"],
            "completion": student_completion(explanation, solution)}


def teacher_sft_data(data, split, n, template, eval_problems=0, seed=0, dead_ends=0.0,
                     near_misses=0.0, mix=None):
    """sft.py's `--data rlt:SOURCE`: the teacher's format warm-up (004 §A.1). Each trace becomes
    a teacher example: the prompt is teacher_prompt with the trace's own answer, the target its
    text up to </think>. SOURCE is a JSONL file of samples (nums, target, completion), as the
    paper's warm-up rewrites its baseline's own distillation traces: here evaluate.py --export's
    accepted samples of the verified teacher, each kept only where the verifier accepts it (the
    file's last rows held out, as file_split); or the generator's spec, one solver trace a
    problem. Returns (prompts, rng -> responses), as sft_data."""
    source = data.partition(":")[2]
    if os.path.isfile(source):  # prompts built here, not matched: they are the teacher's
        rows = file_split(read_jsonl(source, ["nums", "target", "completion"]), split,
                          eval_problems)
        rows = [r for r in rows if verifier.score(r["completion"], r["nums"], r["target"]) == 1.0
                ][:n or None]
        if not rows:
            raise CountdownError(
                f"--data {data}: no sample the verifier accepts in its {split} rows")
        tasks, traces = [{"nums": r["nums"], "target": r["target"]} for r in rows], [
            r["completion"] for r in rows]
    else:
        tasks = load_tasks("gen:" + source, split, n or 20_000)
        rng = random.Random(seed)
        traces = [make_trace(t["nums"], t["target"], rng, dead_ends, near_misses, mix)
                  for t in tasks]
    prompts = [teacher_prompt(t, verifier.extract_answer(x), template)
               for t, x in zip(tasks, traces)]
    explanations = [x.split("</think>")[0] + "</think>" for x in traces]
    return prompts, lambda rng: explanations


def solver_pairs(tasks, template, rng):
    """Paper 001's scripted preference pairs: (prompt, a solver trace, the same trace with one
    operator of its answer flipped), for the tasks whose answer has a flip that misses."""
    out = []
    for t in tasks:
        trace = make_trace(t["nums"], t["target"], rng)
        answer = verifier.extract_answer(trace)
        neg = flip_operator(answer, t["nums"], t["target"], rng)
        if neg is not None:
            out.append((make_prompt(t["nums"], t["target"], template), trace,
                        trace.replace(f"<answer>{answer}</answer>", f"<answer>{neg}</answer>")))
    return out


# ---- the init's solve rates (common.probe's), kept beside a run ----------------------------------
def solve_rates(path, tasks, k, measure):
    """Each task's solve rate (common.probe's): read back from `path` (JSONL) if a run wrote it, else
    `measure()` (a list, one a task) written there atomically; kept on each task as
    task["solve_rate"], with one line on the console. Returns `tasks`."""
    if os.path.exists(path):
        rows = [json.loads(line) for line in open(path)]
        if [(list(r["nums"]), r["target"]) for r in rows] != [(list(t["nums"]), t["target"])
                                                                for t in tasks]:
            raise CountdownError(f"{path} probed other problems than this run's: remove it")
        rates = [r["solve_rate"] for r in rows]
    else:
        rates = measure()
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps({**t, "solve_rate": r}) + "\n" for t, r in zip(tasks, rates))
        os.replace(path + ".tmp", path)
    for t, r in zip(tasks, rates):
        t["solve_rate"] = r
    never, always = sum(r == 0 for r in rates), sum(r == 1 for r in rates)
    print(f"probe: {len(tasks)} problems x {k} samples: the init never solves {never}, always "
          f"{always}, sometimes {len(tasks) - never - always}")
    return tasks


def tiers(tasks, bins):
    """001 Algorithm 1, line 1: task indices in tiers, by operand count, then `bins` equal-count
    bins of the target within each count; smaller counts and targets first."""
    out = []
    for count in sorted({len(t["nums"]) for t in tasks}):
        idx = sorted((i for i, t in enumerate(tasks) if len(t["nums"]) == count),
                     key=lambda i: tasks[i]["target"])
        out += [idx[len(idx) * b // bins: len(idx) * (b + 1) // bins] for b in range(bins)]
    return [tier for tier in out if tier]
