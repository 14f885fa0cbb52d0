"""The page's numbers: runs aggregated per (level, method, N), the tests (Welch's, paired, Wilcoxon), the
pre-registered comparisons, placebo arms and bar, compute and throughput, each with its table."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from benchmarks._page import fmt as _fmt
from benchmarks._page import md_table
from benchmarks.runner.experiment import Bar, Compare, Experiment
from benchmarks.runner.records import Run


def nanmean(x: Sequence[float]) -> float:
    """Mean over the values that are not NaN; NaN (without numpy's warning) where there are none, e.g. a series a run
    recorded before the series were kept lacks."""
    a = np.asarray(x, dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else math.nan


def varies(x: Sequence[float]) -> bool:
    a = np.asarray(x, dtype=np.float64)
    return np.unique(a[np.isfinite(a)]).size > 1


def _mean_sd(x: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def aggregate(runs: list[Run], keys: list[tuple[str, str, int]], caps: Optional[dict[str, float]] = None) -> list[dict]:
    """One row per (level, method, N) in ``keys`` order: mean ± sd over seeds, collapses, the dual's course
    (``caps``: lambda_max per method, for the share of steps at the cap; NaN where a method has none)."""
    caps = caps or {}
    cells = []
    for level, method, n in keys:
        rs = [r for r in runs if (r.level, r.method, r.n) == (level, method, n)]
        if not rs:
            continue
        final, final_sd = _mean_sd([r.final for r in rs])
        peak, peak_sd = _mean_sd([r.peak for r in rs])
        late, late_sd = _mean_sd([r.late for r in rs])
        series = all(r.measured for r in rs)
        cells.append({
            "level": level, "method": method, "N": n, "seeds": len(rs), "seed_ids": [r.seed for r in rs],
            # per run, in seed_ids' order: what the paired tests and the placebo margins read
            "insides": [float(np.mean(np.asarray(r.measured) <= np.asarray(r.tolerance))) if r.measured else math.nan
                        for r in rs],
            "reaches": [r.extra.get("reach", math.nan) for r in rs],
            "spreads": [r.extra.get("spread", math.nan) for r in rs],
            "acc_before": float(np.mean([r.acc_before for r in rs])),
            "final": final, "final_sd": final_sd, "peak": peak, "peak_sd": peak_sd,
            "finals": [r.final for r in rs], "late": late, "late_sd": late_sd, "lates": [r.late for r in rs],
            "collapses": int(sum(r.collapsed for r in rs)),
            # NaN where a run recorded before the per-step series were kept lacks them (no mean over a part)
            "abs_prob_diff": nanmean([nanmean(r.abs_prob_diff) for r in rs]) if series else math.nan,
            # the discrepancy the level produces at the start (first 5 steps), as the x axis is read
            "kl_k3_start": nanmean([nanmean(r.kl_k3[:5]) for r in rs]) if series else math.nan,
            "inside_share": float(np.mean([np.mean(np.asarray(r.measured) <= np.asarray(r.tolerance)) for r in rs]))
                            if series else math.nan,
            "mean_lambda": float(np.nanmean([np.nanmean(r.lambdas) for r in rs])),
            "extreme_share": extreme_share([r.lambdas for r in rs]),
            "final_lambda": float(np.nanmean([r.lambdas[-1] for r in rs])),
            # the dual acting: lambda above 0.01 (a slack dual sits at 0); at its cap: within 1e-9 of lambda_max
            "acting_share": float(np.mean([np.mean(np.asarray(r.lambdas) > 0.01) for r in rs])),
            "cap_share": float(np.mean([np.mean(np.asarray(r.lambdas) >= caps[method] - 1e-9) for r in rs]))
                         if math.isfinite(caps.get(method, math.nan)) else math.nan,
            "extra": {k: float(np.nanmean([r.extra[k] for r in rs])) for k in sorted(set.intersection(
                *(set(r.extra) for r in rs)))},
        })
    return cells


def extreme_share(lambdas: Sequence[Sequence[float]], within: float = 0.01) -> float:
    """Share of steps whose λ lies within ``within`` of its run's range from the run's lowest or highest λ
    (how bang-bang the rule acts), over the runs whose λ moves; NaN when no run's λ moves."""
    shares = []
    for lam in lambdas:
        a = np.asarray(lam, dtype=np.float64)
        a = a[np.isfinite(a)]
        if a.size == 0 or a.max() == a.min():
            continue
        lo, hi = a.min(), a.max()
        margin = within * (hi - lo)
        shares.append(float(np.mean((a <= lo + margin) | (a >= hi - margin))))
    return float(np.mean(shares)) if shares else math.nan


def is_dcmdp(method: str) -> bool:
    return method.startswith("dcmdp")


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Welch's t-test p-value of two samples; NaN with fewer than two values on a side, or with no spread on either
    (the test is undefined there: two constant samples that differ would read p = 0)."""
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2 or (max(a) == min(a) and max(b) == min(b)):
        return math.nan
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def by_seed(cell: dict, key: str) -> dict[int, float]:
    """A cell's per-run values (``key``: "finals", "lates", "insides", ...) by RL seed (cells from a page record
    written before seeds were kept: empty, so nothing pairs)."""
    return dict(zip(cell.get("seed_ids", []), cell.get(key, [])))


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """The paired comparison of two methods over the seeds both ran (a seed shares its cold start and its RL seed on
    both sides): n, the mean difference a - b, the paired t-test's p and the Wilcoxon signed-rank test's p
    (scipy.stats.ttest_rel, wilcoxon; two-sided). p is NaN with fewer than two pairs, the t-test's also with no spread
    in the differences (undefined), Wilcoxon's with every difference 0."""
    from scipy.stats import ttest_rel, wilcoxon

    seeds = [s for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    d = np.asarray([a[s] - b[s] for s in seeds], dtype=np.float64)
    out = {"n": len(seeds), "diff": float(d.mean()) if d.size else math.nan, "p_t": math.nan, "p_wilcoxon": math.nan}
    if d.size >= 2 and np.ptp(d) > 1e-12:  # differences equal up to rounding: no spread, as in welch_p
        out["p_t"] = float(ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)
    if d.size >= 2 and np.any(d != 0):
        out["p_wilcoxon"] = float(wilcoxon(d).pvalue)
    return out


def welch(cells: list[dict]) -> list[dict]:
    """Per (level, N) and DCMDP config: against the best other method by mean final accuracy, and by late accuracy
    against the best by late accuracy."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = [c for c in cells if (c["level"], c["N"]) == key]
        others = [c for c in here if not is_dcmdp(c["method"])]
        if not others:
            continue
        best = max(others, key=lambda c: c["final"])
        best_late = max(others, key=lambda c: c["late"])
        for mine in (c for c in here if is_dcmdp(c["method"])):
            out.append({"level": key[0], "N": key[1], "method": mine["method"], "best_baseline": best["method"],
                        "dcmdp": mine["final"], "baseline": best["final"], "diff": mine["final"] - best["final"],
                        "p": welch_p(mine["finals"], best["finals"]), "best_late_baseline": best_late["method"],
                        "late_diff": mine["late"] - best_late["late"],
                        "p_late": welch_p(mine["lates"], best_late["lates"]),
                        "p_late_paired": paired(by_seed(mine, "lates"), by_seed(best_late, "lates"))["p_t"],
                        "seeds": f"{len(mine['finals'])} vs {len(best['finals'])}"})
    return out


def reading(diff: float, p: float, alpha: float = 0.05) -> str:
    """'ahead' / 'behind' where Welch's p < alpha, 'level' where p >= alpha, and 'untested' where p is undefined
    (fewer than two seeds on a side): one seed each can be neither level nor ahead by the test."""
    if not math.isfinite(p):
        return "untested"
    if not p < alpha:
        return "level"
    return "ahead" if diff > 0 else "behind"


def compare_rows(cmp: Compare, cells: list[dict]) -> list[dict]:
    """Per (level, N), config and rival role: the config against the role's candidate with the best late mean in
    that cell (late and final accuracy, Welch's t-test on each, collapses)."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config in (m for m in cmp.configs if m in here):
            mine = here[config]
            for role in cmp.rivals:
                present = [here[m] for m in cmp.rival_candidates(role, key[0]) if m in here]
                if not present:
                    continue
                rival = max(present, key=lambda c: c["late"])
                p_late = welch_p(mine["lates"], rival["lates"])
                pair = paired(by_seed(mine, "lates"), by_seed(rival, "lates"))
                pair_final = paired(by_seed(mine, "finals"), by_seed(rival, "finals"))
                out.append({"level": key[0], "N": key[1], "config": config, "role": role, "rival": rival["method"],
                            "late": mine["late"], "late_sd": mine["late_sd"], "rival_late": rival["late"],
                            "rival_late_sd": rival["late_sd"], "late_diff": mine["late"] - rival["late"],
                            "p_late": p_late, "final_diff": mine["final"] - rival["final"],
                            "p_final": welch_p(mine["finals"], rival["finals"]),
                            "reading": reading(mine["late"] - rival["late"], p_late),
                            "paired_n": pair["n"], "paired_late_diff": pair["diff"], "p_late_paired": pair["p_t"],
                            "p_late_wilcoxon": pair["p_wilcoxon"], "p_final_paired": pair_final["p_t"],
                            "reading_paired": reading(pair["diff"], pair["p_t"]),
                            "collapses": f"{mine['collapses']}/{mine['seeds']} vs {rival['collapses']}/{rival['seeds']}"})
    return out


def compare_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "config", "rival (role)", "config late", "rival late", "late difference", "late Welch p",
         "reading", "paired seeds", "late paired t p", "late Wilcoxon p", "paired reading", "final difference",
         "final Welch p", "final paired t p", "collapses"),
        [(r["N"], r["level"], r["config"], f"{r['rival']} ({r['role']})", f"{r['late']:.3f} ± {r['late_sd']:.3f}",
          f"{r['rival_late']:.3f} ± {r['rival_late_sd']:.3f}", f"{r['late_diff']:+.3f}", f"{r['p_late']:.3g}",
          r["reading"], r.get("paired_n", 0), _fmt(r.get("p_late_paired", math.nan)),
          _fmt(r.get("p_late_wilcoxon", math.nan)), r.get("reading_paired", "untested"), f"{r['final_diff']:+.3f}",
          f"{r['p_final']:.3g}", _fmt(r.get("p_final_paired", math.nan)), r["collapses"]) for r in rows])


def placebo_rows(cmp: Compare, cells: list[dict]) -> list[dict]:
    """Per (level, N), config and placebo arm: the share of steps inside c, paired per seed (config - placebo), over
    every seed both ran and over the seeds whose config run had authority (its penalty's reach above its batch
    spread, from the run's summary); the paired t-test of the margin; the config's mean reach and spread."""
    out = []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config, arms in cmp.placebos.items():
            if config not in here:
                continue
            mine = here[config]
            reach, spread = by_seed(mine, "reaches"), by_seed(mine, "spreads")
            authority = {s for s in reach if reach[s] > spread.get(s, math.nan)}  # NaN compares False
            measured = {s for s in reach if math.isfinite(reach[s]) and math.isfinite(spread.get(s, math.nan))}
            for arm in arms:
                if arm not in here:
                    continue
                inside, other = by_seed(mine, "insides"), by_seed(here[arm], "insides")
                every = paired(inside, other)
                held = paired({s: v for s, v in inside.items() if s in authority}, other)
                out.append({"level": key[0], "N": key[1], "config": config, "placebo": arm,
                            "inside": nanmean(list(inside.values())), "placebo_inside": nanmean(list(other.values())),
                            "margin": every["diff"], "p_margin": every["p_t"], "n": every["n"],
                            "authority_seeds": held["n"], "measured_seeds": len(measured),
                            "margin_authority": held["diff"],
                            "p_margin_authority": held["p_t"], "reach": nanmean(list(reach.values())),
                            "spread": nanmean(list(spread.values()))})
    return out


def placebo_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "config", "placebo", "config inside c", "placebo inside c", "paired margin", "paired t p",
         "seeds", "config reach", "config spread", "seeds with reach > spread", "margin there"),
        [(r["N"], r["level"], r["config"], r["placebo"], _fmt(r["inside"], ".0%"), _fmt(r["placebo_inside"], ".0%"),
          _fmt(100 * r["margin"], "+.1f") + " pts" if math.isfinite(r["margin"]) else "-", _fmt(r["p_margin"]), r["n"],
          _fmt(r["reach"]), _fmt(r["spread"]), f"{r['authority_seeds']} of {r['measured_seeds']}",
          _fmt(100 * r["margin_authority"], "+.1f") + " pts" if math.isfinite(r["margin_authority"]) else "-")
         for r in rows])


def bar_rows(cmp: Compare, cells: list[dict], compared: list[dict], missing: dict[tuple[str, int], int],
             expected: Optional[set[tuple[str, str, int]]] = None) -> list[dict]:
    """Per (level, N) and config: each clause of the pre-registered bar with its measured value and whether it is met,
    and the verdict: "met", "not met" (naming the clauses that fail) or "not decided" (``missing``: runs of the
    profile in that cell that have not finished; a clause with nothing to measure it). A (level, N) with runs missing
    and none finished gets a "not decided" row per config the profile runs there (``expected``: its (level, method,
    N) cells; every config where not given)."""
    bar = cmp.bar
    if bar is None:
        return []
    out = []
    placebos = placebo_rows(cmp, cells) if bar.placebo_margin is not None else []
    for key in dict.fromkeys((c["level"], c["N"]) for c in cells):
        here = {c["method"]: c for c in cells if (c["level"], c["N"]) == key}
        for config in (m for m in cmp.configs if m in here):
            mine, clauses = here[config], []
            for role, need in bar.roles.items():
                row = next((r for r in compared if (r["level"], r["N"], r["config"], r["role"]) == (*key, config, role)),
                           None)
                if row is None:
                    clauses.append((f"vs {role} ({need})", "no run", None))
                else:
                    read, p, diff, how = ((row["reading_paired"], row["p_late_paired"], row["paired_late_diff"],
                                           f"paired over {row['paired_n']} seeds") if bar.paired else
                                          (row["reading"], row["p_late"], row["late_diff"], "Welch"))
                    ok = None if read == "untested" else read == "ahead" or (need == "level" and read == "level")
                    clauses.append((f"vs {role} ({need})", f"{read} vs {row['rival']}, {diff:+.3f}, {how} p = {p:.2g}",
                                    ok))
            if bar.collapses is not None:
                clauses.append((f"collapses (<= {bar.collapses})", f"{mine['collapses']}/{mine['seeds']}",
                                mine["collapses"] <= bar.collapses))
            if bar.collapses_vs is not None:
                present = [here[m] for m in cmp.rival_candidates(bar.collapses_vs, key[0]) if m in here]
                if not present:
                    clauses.append((f"collapses (<= {bar.collapses_vs})", "no run", None))
                else:
                    rival = max(present, key=lambda c: c["late"])
                    clauses.append((f"collapses (<= {bar.collapses_vs})", f"{mine['collapses']}/{mine['seeds']} vs "
                                    f"{rival['collapses']}/{rival['seeds']} ({rival['method']})",
                                    mine["collapses"] <= rival["collapses"]))
            if bar.placebo_margin is not None:
                for arm in cmp.placebos.get(config, ()):
                    row = next((r for r in placebos if (r["level"], r["N"], r["config"], r["placebo"])
                                == (*key, config, arm)), None)
                    name = f"inside c over {arm} (>= {100 * bar.placebo_margin:.0f} pts where reach > spread)"
                    if row is None:
                        clauses.append((name, "no run", None))
                    elif row["measured_seeds"] == 0:  # reach or spread not in the runs' summaries: not measured
                        clauses.append((name, "reach or spread not measured", None))
                    elif row["authority_seeds"] == 0:  # the penalty had no authority: the accuracy clause is judged
                        clauses.append((name, f"does not apply: reach <= spread on every seed "
                                        f"({row['measured_seeds']})", True))
                    else:
                        m = row["margin_authority"]
                        clauses.append((name, f"{100 * m:+.1f} pts paired over {row['authority_seeds']} of "
                                        f"{row['measured_seeds']} seeds", m >= bar.placebo_margin))
            if bar.inside_c is not None:
                v = mine["inside_share"]
                clauses.append((f"inside c (>= {bar.inside_c:.0%})", "-" if not math.isfinite(v) else f"{v:.0%}",
                                None if not math.isfinite(v) else v >= bar.inside_c))
            if bar.below_cap is not None:
                # a config without a finite cap is below it on every step
                v = 1.0 - mine["cap_share"] if math.isfinite(mine["cap_share"]) else 1.0
                clauses.append((f"λ below its cap (>= {bar.below_cap:.0%})", f"{v:.0%}", v >= bar.below_cap))
            if bar.acting is not None:
                # an idle dual meets the clauses above without doing anything: this one asks that it acts
                v = mine.get("acting_share", math.nan)
                clauses.append((f"λ > 0.01 (>= {bar.acting:.0%})", "-" if not math.isfinite(v) else f"{v:.0%}",
                                None if not math.isfinite(v) else v >= bar.acting))
            gone = missing.get(key, 0)
            failed = [name for name, _, ok in clauses if ok is False]
            if gone or any(ok is None for _, _, ok in clauses):
                verdict = (f"not decided ({gone} of the cell's runs not finished)" if gone
                           else "not decided (a clause has no run, or too few seeds, to measure it)")
            else:
                verdict = "met" if not failed else "not met: " + "; ".join(failed)
            out.append({"level": key[0], "N": key[1], "config": config, "verdict": verdict,
                        "clauses": [{"clause": n, "value": v, "met": ok} for n, v, ok in clauses]})
    # a level of the profile none of whose runs has finished: its row says so rather than leaving the level out
    for key, gone in missing.items():
        if not any((c["level"], c["N"]) == key for c in cells):
            out += [{"level": key[0], "N": key[1], "config": config, "clauses": [],
                     "verdict": f"not decided ({gone} of the cell's runs not finished)"} for config in cmp.configs
                    if expected is None or (key[0], config, key[1]) in expected]
    return out


def bar_across(cmp: Compare, compared: list[dict], missing: dict[tuple[str, int], int],
               configs: Optional[set[str]] = None) -> list[dict]:
    """The bar's clause across levels (``ahead_somewhere``), per config and role: met when the config reads ahead of
    the role's candidate on at least one level of the page; not decided while none does and a level has runs missing
    (or has no reading yet); else not met. Each entry keeps the per-level readings it was decided on. ``configs``:
    the configs the profile runs (every config of the block where not given)."""
    bar = cmp.bar
    if bar is None or not bar.ahead_somewhere:
        return []
    out = []
    for config in (c for c in cmp.configs if configs is None or c in configs):
        for role in bar.ahead_somewhere:
            rows = [r for r in compared if r["config"] == config and r["role"] == role]
            ahead = any(r["reading"] == "ahead" for r in rows)
            met = True if ahead else (None if missing or any(r["reading"] == "untested" for r in rows) else False)
            out.append({"config": config, "role": role, "met": met,
                        "readings": [{"level": r["level"], "N": r["N"], "reading": r["reading"],
                                      "late_diff": r["late_diff"], "p_late": r["p_late"]} for r in rows]})
    return out


def met_on_line(bar: Bar, rows: list[dict]) -> str:
    """The clause across levels ``met_on``: per config, the bar met on at least that many of its (level, N) cells;
    not decided while the cells still undecided could carry it over."""
    parts = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        met = sum(r["verdict"] == "met" for r in mine)
        open_ = sum(r["verdict"].startswith("not decided") for r in mine)
        state = ("met" if met >= bar.met_on else "not decided" if met + open_ >= bar.met_on else "**not met**")
        parts.append(f"{config}: met on {met} of {len(mine)} ({state})")
    return f"The bar met on at least {bar.met_on} cells: " + "; ".join(parts) + "."


def bar_across_lines(rows: list[dict]) -> list[str]:
    mark = {True: "met", False: "**not met**", None: "not decided (runs missing)"}
    return [f"- {r['config']} ahead of the {r['role']} on at least one level: {mark[r['met']]} ("
            + ("; ".join(f"{x['reading']} at {x['level']}, {x['late_diff']:+.3f}, p = {x['p_late']:.2g}"
                         for x in r["readings"]) or "no reading yet") + ")" for r in rows]


def bar_table(rows: list[dict]) -> list[str]:
    mark = {True: "met", False: "**not met**", None: "not decided"}
    names = list(dict.fromkeys(c["clause"] for r in rows for c in r["clauses"]))
    body = []
    for r in rows:
        by = {c["clause"]: c for c in r["clauses"]}
        body.append((r["N"], r["level"], r["config"],
                     *(f"{by[n]['value']} ({mark[by[n]['met']]})" if n in by else "-" for n in names), r["verdict"]))
    return md_table(("N", "level", "config", *names, "the bar"), body)


def compute_rows(cmp: Compare, runs: list[Run]) -> list[dict]:
    """Per level: the run-minutes of each config, each rival candidate, and each ``compute`` group (its methods'
    runs summed: a tuned constant's sweep counts toward it)."""
    out = []
    for level in dict.fromkeys(r.level for r in runs):
        groups = [(m, (m,)) for m in cmp.configs]
        groups += [(m, (m,)) for role in cmp.rivals for m in cmp.rival_candidates(role, level)]
        groups += list(cmp.compute.items())
        for label, ms in dict.fromkeys(groups):
            rs = [r for r in runs if r.level == level and r.method in ms]
            if rs:
                out.append({"level": level, "what": label, "methods": list(ms), "runs": len(rs),
                            "run_minutes": sum(r.seconds for r in rs) / 60})
    return out


def table(cells: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "kl_k3 at start", "method", "final held-out acc", "late held-out acc", "peak held-out acc",
         "collapses", "mean abs_prob_diff", "steps inside c", "mean λ", "final λ", "λ at its extremes", "λ > 0.01",
         "λ at its cap"),
        [(c["N"], c["level"], _fmt(c["kl_k3_start"], ".2e"), c["method"], f"{c['final']:.3f} ± {c['final_sd']:.3f}",
          f"{c['late']:.3f} ± {c['late_sd']:.3f}", f"{c['peak']:.3f} ± {c['peak_sd']:.3f}",
          f"{c['collapses']}/{c['seeds']}", _fmt(c["abs_prob_diff"], ".2e"), _fmt(c["inside_share"], ".0%"),
          f"{c['mean_lambda']:.3g}", f"{c['final_lambda']:.3g}", _fmt(c["extreme_share"], ".0%"),
          _fmt(c.get("acting_share", math.nan), ".0%"), _fmt(c.get("cap_share", math.nan), ".0%")) for c in cells])


def welch_table(rows: list[dict]) -> list[str]:
    return md_table(
        ("N", "level", "DCMDP config", "its final acc", "best baseline", "its final acc", "difference", "Welch p",
         "best by late acc", "late difference", "late Welch p", "late paired t p", "seeds"),
        [(r["N"], r["level"], r["method"], f"{r['dcmdp']:.3f}", r["best_baseline"], f"{r['baseline']:.3f}",
          f"{r['diff']:+.3f}", f"{r['p']:.3g}", r["best_late_baseline"], f"{r['late_diff']:+.3f}",
          f"{r['p_late']:.3g}", _fmt(r.get("p_late_paired", math.nan)), r["seeds"]) for r in rows])


def throughput_rows(exp: Experiment, runs: list[Run]) -> list[dict]:
    """Per (level, method, N): end-to-end tokens/s as a ratio to ``exp.reference`` at the same level, N and seed
    (mean ± sd over the seeds both ran), idle shares, the mean bound and late accuracy; [] without a reference."""
    ref = {(r.level, r.n, r.seed): r.extra.get("tokens_per_s", math.nan) for r in runs if r.method == exp.reference}
    out = []
    for key in dict.fromkeys((r.level, r.method, r.n) for r in runs):
        rs = [r for r in runs if (r.level, r.method, r.n) == key]
        ratios = [r.extra.get("tokens_per_s", math.nan) / ref[(r.level, r.n, r.seed)] for r in rs
                  if (r.level, r.n, r.seed) in ref]
        if not exp.reference or not ratios:
            continue
        mean = {k: float(np.nanmean([r.extra.get(k, math.nan) for r in rs])) for k in
                ("tokens_per_s", "time/trainer_idle_frac", "time/rollout_idle_frac", "async/bound")}
        out.append({"level": key[0], "method": key[1], "N": key[2], "ratio": _mean_sd(ratios), "late":
                    _mean_sd([r.late for r in rs]), "collapses": sum(r.collapsed for r in rs), "seeds": len(rs), **mean})
    return out


def throughput_lines(exp: Experiment, rows: list[dict]) -> list[str]:
    def pm(x: tuple[float, float], fmt: str) -> str:
        return f"{x[0]:{fmt}} ± {x[1]:{fmt}}"

    return ["", f"End-to-end throughput (response tokens of every step over the steps' wall time, rollout waits "
            f"included) as a ratio to {exp.reference} at the same level, N and seed, mean ± sd over seeds; idle "
            "shares are means over steps (trainer: waiting for a batch; rollout worker: waiting for weights):", "",
            *md_table(("level", "N", "method", "tokens/s", f"ratio to {exp.reference}", "trainer idle",
                        "rollout idle", "mean bound", "late held-out acc", "collapses"),
                       [(r["level"], r["N"], r["method"], f"{r['tokens_per_s']:.0f}", pm(r["ratio"], ".2f"),
                         f"{r['time/trainer_idle_frac']:.0%}", f"{r['time/rollout_idle_frac']:.0%}",
                         f"{r['async/bound']:.2f}", pm(r["late"], ".3f"), f"{r['collapses']}/{r['seeds']}")
                        for r in rows])]
