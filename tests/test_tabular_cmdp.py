"""Exact check of docs/design.md §"The Lagrangian": on a small tabular constrained MDP the dual controller reaches the optimum.

MDP: 4 states, 3 actions, discount 0.9, random transitions, reward r(s, a), cost k(s, a) correlated with the
reward (so that the constraint binds), uniform initial distribution; seed 0. Values are normalised,
J = (1 - gamma) E[sum_t gamma^t x_t] = sum_{s,a} q(s, a) x(s, a) with q the normalised occupancy measure.

Reference: the occupancy-measure LP  max_q <q, r>  s.t. the flow constraints, q >= 0, <q, k> <= limit, solved
with cvxpy; the optimal multiplier lambda* is the dual value of the cost constraint. The limit sits at 80% of
the way from the smallest achievable cost to the cost of the unconstrained optimum: the constraint is active,
lambda* > 0, and the uniform initial policy is feasible, so the overshoot is the controller's own.

Learner: a tabular softmax policy pi(a|s) = softmax(theta[s]) trained on the Lagrangian
J_r - lambda (J_k - limit) with EXACT policy gradients from the model, in their natural-gradient form
(Kakade 2001; for the tabular softmax the Fisher-preconditioned step is theta += eta A_L(s, a) / (1 - gamma),
Agarwal et al. 2021), one primal step per dual step. The natural form is used because the plain softmax
gradient d(s) pi(a|s) A(s, a) vanishes as the policy becomes deterministic in the states where the
optimum is deterministic, so the policy lags lambda by hundreds of dual steps. Around it: ``dual_step`` with
one ConstraintConfig whose tolerance is the limit, measuring D = J_k of the current policy.

What is compared: the AVERAGE of the iterates (J_r, J_k, lambda) over the second half of the run, for both
rules. Primal-dual ascent on a linear program converges in this ergodic sense (the dual function is
piecewise linear, the best response jumps between deterministic policies, and the projected rule's last
iterate keeps cycling around the saddle point); the PID rule's proportional term damps that cycle, so its
LAST iterate is asserted as well. Tolerances: value within 2% of the LP optimum, lambda within 10% of
lambda*, constraint within 2% of the limit; PID overshoots the limit less than the projected rule.
"""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import torch

from constraints.config import ConstraintConfig
from dcmdp.config import DualConfig, PIDConfig
from dcmdp.dual import dual_step, init_state

torch.set_num_threads(1)

S, A, GAMMA = 4, 3, 0.9
DUAL_STEPS = 2000
PRIMAL_LR = 0.1
PID = PIDConfig(kp=5.0, kd=20.0, alpha_p=0.0, alpha_d=0.0, delay=1)  # exact costs: no smoothing needed


def _mdp():
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.full(S, 0.5), size=(S, A))  # P[s, a, s']
    r = rng.uniform(0, 1, size=(S, A))
    k = 0.5 * rng.uniform(0, 1, size=(S, A)) + 0.5 * r
    rho0 = np.full(S, 1.0 / S)
    return P, r, k, rho0


def _occupancy_lp(P, rho0, objective, sense, cost=None, limit=None):
    """Optimum over normalised occupancy measures q; returns (value, cost-constraint dual)."""
    q = cp.Variable((S, A), nonneg=True)
    cons = [cp.sum(q[s, :]) == (1 - GAMMA) * rho0[s] + GAMMA * cp.sum(cp.multiply(P[:, :, s], q)) for s in range(S)]
    if cost is not None:
        cons.append(cp.sum(cp.multiply(cost, q)) <= limit)
    value = cp.sum(cp.multiply(objective, q))
    problem = cp.Problem(cp.Maximize(value) if sense == "max" else cp.Minimize(value), cons)
    problem.solve(solver=cp.CLARABEL)
    assert problem.status == cp.OPTIMAL
    return problem.value, q.value, (cons[-1].dual_value if cost is not None else None)


def _evaluate(theta, P, r, k, rho0):
    """Normalised J_r, J_k and the advantages A_r, A_k (S, A) of the softmax policy, exactly."""
    pi = np.exp(theta - theta.max(axis=1, keepdims=True))
    pi /= pi.sum(axis=1, keepdims=True)
    M = np.eye(S) - GAMMA * np.einsum("sa,sat->st", pi, P)
    out = []
    for x in (r, k):
        V = np.linalg.solve(M, (pi * x).sum(axis=1))
        Q = x + GAMMA * P @ V
        out += [(1 - GAMMA) * rho0 @ V, Q - V[:, None]]
    return out


def _run(rule: str, limit: float, mdp) -> np.ndarray:
    """(DUAL_STEPS, 3) trajectory of (J_r, J_k, lambda) measured before each dual step."""
    P, r, k, rho0 = mdp
    cfg = DualConfig(rule=rule, pid=PID, constraints=[
        ConstraintConfig(measure="abs_prob_diff", tolerance=limit, lambda_init=0.0, lambda_max=100.0, lr=1.0)])
    state = init_state(cfg)
    theta = np.zeros((S, A))
    history = np.zeros((DUAL_STEPS, 3))
    for step in range(DUAL_STEPS):
        j_r, adv_r, j_k, adv_k = _evaluate(theta, P, r, k, rho0)
        history[step] = j_r, j_k, state.lambda_C.item()
        state, _ = dual_step(state, torch.tensor([j_k], dtype=torch.float64), cfg)
        lam = state.lambda_C.item()
        theta = theta + PRIMAL_LR / (1 - GAMMA) * (adv_r - lam * adv_k)
    return history


def _settle(rel_cost_gap: np.ndarray, tol: float = 0.02) -> int | None:
    """First step after which |J_k - limit| / limit stays within tol; None if it never does."""
    outside = np.flatnonzero(np.abs(rel_cost_gap) > tol)
    if len(outside) == 0:
        return 0
    return None if outside[-1] == len(rel_cost_gap) - 1 else int(outside[-1] + 1)


def test_dual_controller_reaches_the_lp_optimum():
    mdp = _mdp()
    P, r, k, rho0 = mdp
    _, q_free, _ = _occupancy_lp(P, rho0, r, "max")
    cost_free = float((k * q_free).sum())
    cost_min, _, _ = _occupancy_lp(P, rho0, k, "min")
    limit = cost_min + 0.8 * (cost_free - cost_min)
    v_star, _, lam_star = _occupancy_lp(P, rho0, r, "max", cost=k, limit=limit)
    lam_star = float(lam_star)
    j_k_uniform = _evaluate(np.zeros((S, A)), P, r, k, rho0)[2]
    assert lam_star > 0.1 and j_k_uniform < limit  # active constraint, feasible start

    results = {}
    for rule in ("projected", "pid"):
        h = _run(rule, limit, mdp)
        avg = h[DUAL_STEPS // 2:].mean(axis=0)
        last = h[-1]
        rel_cost = (h[:, 1] - limit) / limit
        res = {"value_gap": (avg[0] - v_star) / v_star, "lambda_gap": (avg[2] - lam_star) / lam_star,
               "cost_gap": (avg[1] - limit) / limit,
               "last_value_gap": (last[0] - v_star) / v_star, "last_lambda_gap": (last[2] - lam_star) / lam_star,
               "last_cost_gap": (last[1] - limit) / limit,
               "overshoot": float(rel_cost.max()), "tail_cycle": float(np.abs(rel_cost[DUAL_STEPS // 2:]).max()),
               "settle": _settle(rel_cost)}
        results[rule] = res
        settle = ("never settles within 2% (it keeps cycling)" if res["settle"] is None
                  else f"settles within 2% after {res['settle']} of {DUAL_STEPS} dual steps")
        print(f"\n[{rule}] LP: V*={v_star:.5f} lambda*={lam_star:.5f} limit={limit:.5f}\n"
              f"  average of iterates {DUAL_STEPS // 2}..{DUAL_STEPS}: value gap {res['value_gap']:+.3%}, "
              f"lambda gap {res['lambda_gap']:+.3%}, constraint gap {res['cost_gap']:+.3%}\n"
              f"  last iterate: value gap {res['last_value_gap']:+.3%}, lambda gap {res['last_lambda_gap']:+.3%}, "
              f"constraint gap {res['last_cost_gap']:+.3%}\n"
              f"  max constraint overshoot {res['overshoot']:+.3%} of the limit; the last-iterate cost {settle}; "
              f"largest |constraint gap| over the second half {res['tail_cycle']:.3%}")

    for rule, res in results.items():
        assert abs(res["value_gap"]) <= 0.02, rule
        assert abs(res["lambda_gap"]) <= 0.10, rule
        assert abs(res["cost_gap"]) <= 0.02, rule
    pid = results["pid"]
    assert abs(pid["last_value_gap"]) <= 0.02 and abs(pid["last_lambda_gap"]) <= 0.10
    assert abs(pid["last_cost_gap"]) <= 0.02 and pid["settle"] is not None
    assert pid["overshoot"] < results["projected"]["overshoot"]
