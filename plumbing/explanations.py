"""RLT's explanations (rlt.py): which problems the teacher explains, the λ / α its reward is
balanced with, and the export of its explanations as a student's SFT data (paper 004 §3.2, §A.1,
Table 4). The teacher's and the student's prompt formats, and the teacher's format warm-up (sft.py's
`--data rlt:`), are data like every script's: plumbing/tasks.py."""
import itertools
import json
import os

from plumbing import distributed as ranks
from plumbing.flags import CountdownError
from plumbing.tasks import load_tasks, write_jsonl
from plumbing.traces import arithmetic
from verifier import solve


# ---- which problems the teacher explains ---------------------------------------------------------
def rlt_tasks(data, eval_data, eval_problems, n=None):
    """(train tasks, held-out (task, solution) pairs). The teacher explains the solver's equation;
    a train task without one (possible in a hub dataset) is skipped as it is drawn (next_solved):
    a 490k-row hub dataset of 4-number problems takes minutes to solve up front."""
    tasks = load_tasks(data, "train", n)
    eval_tasks = solved(load_tasks(eval_data, "val", eval_problems))
    if not eval_tasks or not solved(tasks, 1):
        raise CountdownError(f"no solvable tasks in {data if eval_tasks else eval_data}")
    return tasks, eval_tasks


def solved(tasks, n=None):
    """(task, solution) for the first n tasks that have one the traces' format can write: the
    restricted solver's (every intermediate a non-negative integer, as plumbing/traces.py writes `a op b = v`
    lines). An expression like `18 - (1 - 7)` or `12 / (6 / 17)` has a step no explanation in that
    format can state, so its problem is left out (7.5 % of the embedded training problems; a hub
    dataset's 4-number problems are solved as needed: all 490k up front would take minutes)."""
    pairs = ((t, solve(t["nums"], t["target"], restricted=True)) for t in tasks)
    return list(itertools.islice(((t, s) for t, s in pairs if s is not None), n))


def next_solved(run, tasks, n):
    """The next n solvable tasks of the run's shuffled order, as (task, solution): unsolvable tasks
    drop out, so draw until n are in (reshuffling when the order runs out). Under torchrun, n is a
    rank's share: the step draws n x N and takes this rank's (run.share)."""
    batch, n = [], n * ranks.world()
    while len(batch) < n:
        if not run.order:
            run.order = run.rng.sample(range(len(tasks)), len(tasks))
        take, run.order = run.order[:n - len(batch)], run.order[n - len(batch):]
        batch += solved([tasks[i] for i in take])
    return run.share(batch)


def balance_weights(parts):
    """004 §A.1's rule for λ and α: "each individual component of the RLT rewards [has]
    approximately the same expected magnitude over the model's initial output completions".
    parts (N, 4): per completion avg log π_s(s), min log π_s(s), avg KL_t, max KL_t (rlt.py's
    reward_parts). With one α for both rewards and one λ, four sizes cannot all match: α puts
    each reward's min / max term as near its mean term as one number can (the geometric mean of
    the two ratios), then λ makes λ r_KL as large as r_SS. Returns (α, λ)."""
    m = parts.abs().mean(0).tolist()                                                   # (4,)
    if min(m) <= 0:  # (then also E|r_KL| > 0)
        raise CountdownError("cannot balance the reward: a term is 0 on every initial explanation "
                             "(empty explanations?); give --lam and --alpha with --no-balance")
    alpha = (m[0] / m[1] * m[2] / m[3]) ** 0.5
    r_ss, r_kl = parts[:, 0] + alpha * parts[:, 1], parts[:, 2] + alpha * parts[:, 3]  # (N,)
    return alpha, (r_ss.abs().mean() / r_kl.abs().mean()).item()


def measure_balance(explain_fn, parts_of, pairs, n):
    """(α, λ, info): balance_weights over n explanations of each (task, solution) pair by the
    teacher as it starts; parts_of(tasks, sols, explanations) -> (N, 4)."""
    tasks, sols = zip(*pairs)
    _, expl, _ = explain_fn(tasks, sols, n)
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    parts = parts_of(rep(tasks), rep(sols), expl)                                       # (N, 4)
    alpha, lam = balance_weights(parts)
    m = parts.abs().mean(0).tolist()
    print(f"reward balanced on {len(expl)} initial explanations (004 §A.1): |avg log p| "
          f"{m[0]:.3g}, |min log p| {m[1]:.3g}, |avg KL_t| {m[2]:.3g}, |max KL_t| {m[3]:.3g} -> "
          f"α {alpha:.3g}, λ {lam:.3g}")
    return alpha, lam, {"explanations": len(expl), "abs_mean_parts": m}


def balanced(output_dir, init, measure):
    """(α, λ) of this run: saved in OUTPUT_DIR/balance.json by its start (a resumed run keeps
    them), else those its --init teacher was trained with, else measure() -> (α, λ, info) on the
    initial completions, then saved (by rank 0; every rank measures the same, per-prompt draws)."""
    ranks.barrier()  # every rank has looked before rank 0 writes
    for d in (output_dir, init):
        path = os.path.join(d, "balance.json")
        if os.path.isfile(path):
            with open(path) as f:
                b = json.load(f)
            return b["alpha"], b["lam"]
    alpha, lam, info = measure()
    if ranks.rank():
        return alpha, lam
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "balance.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"alpha": alpha, "lam": lam, **info}, f, indent=1)
    os.replace(path + ".tmp", path)
    return alpha, lam


def quantiles(xs, qs=(0.5, 0.9, 0.95, 0.99)):
    xs = sorted(xs)
    return {f"p{round(q * 100)}": xs[min(len(xs) - 1, int(q * len(xs)))] for q in qs} if xs else {}


def export_traces(path, explain_fn, score_fn, tasks, sols, k, to_row, seed, verified=False,
                  redraws=0):
    """sft.py-ready JSONL: per problem the best-r_SS explanation of k, as to_row(task,
    explanation, solution) writes it (the student format); with `verified`, of those whose steps
    traces.arithmetic finds no fault in (r_SS checks no step). An explanation that runs past the
    budget untagged is no trace: a problem with none that closed is drawn again, up to `redraws`
    times (004 §B: "up to 16 reasoning traces [...] selected anyone below [the budget]"), else left
    out. The share that closed and their lengths are printed and saved (PATH.stats.json)."""
    cands, todo, lengths, drawn, first = [[] for _ in tasks], list(range(len(tasks))), [], 0, None
    rep = lambda xs: [x for x in xs for _ in range(k)]  # noqa: E731
    for r in range(redraws + 1):
        for s in range(0, len(todo), 256):
            idx = todo[s:s + 256]
            ts, ss = [tasks[i] for i in idx], [sols[i] for i in idx]
            ro, expl, pen = explain_fn(ts, ss, k, seed=seed + 1 + s + 100_003 * r)
            r_ss = score_fn(rep(ts), rep(ss), expl, pen)[1]
            drawn += len(expl)
            lengths += [len(ids) for ids, p in zip(ro.completion_ids, pen) if not p]
            for j, i in enumerate(idx):
                cands[i] += [(r_ss[m].item(), expl[m]) for m in range(j * k, (j + 1) * k)
                             if not pen[m] and not (verified and any(arithmetic(
                                 [expl[m]], [tasks[i]["target"]])[x] for x in ("step_error",
                                                                                "false_claims")))]
        first = first if first is not None else len(lengths) / max(1, drawn)
        todo = [i for i in todo if not cands[i]]
    rows = [{**to_row(t, max(c)[1], sol), "r_ss": max(c)[0]}
            for t, sol, c in zip(tasks, sols, cands) if c]
    write_jsonl(path, rows)
    stats = {"problems": len(tasks), "exported": len(rows), "explanations": drawn,
             "closed_first_draw": first, "closed": len(lengths) / max(1, drawn),
             "closed_tokens": quantiles(lengths)}
    with open(path + ".stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    print(f"exported {len(rows)} traces of {len(tasks)} problems to {path}; of the first draw "
          f"{100 * first:.1f} % closed </think>; {drawn} explanations drawn in all, their closed "
          f"ones' tokens {stats['closed_tokens']}")
