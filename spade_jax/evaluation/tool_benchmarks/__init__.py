"""Tool-use benchmarks read in their own file formats: BFCL v4 multi-turn (`bfcl`),
tau2-bench (`tau2`) and ACEBench-Agent (`acebench`); shared policy / backend / call
plumbing in `common`; a model behind the policy and user signatures in `model_policy`.
See docs/evaluation.md, "Tool-use benchmarks".

    tasks = load_bfcl("BFCL_v4_multi_turn_base.json", "possible_answer/...json", "func_doc/")
    scores = evaluate_bfcl(tasks, policy, backends={"GorillaFileSystem": "mypkg.fs:GorillaFileSystem"})
"""

from spade_jax.evaluation.tool_benchmarks.acebench import (
    AceTask,
    evaluate_acebench,
    load_acebench,
    run_acebench,
    score_acebench,
)
from spade_jax.evaluation.tool_benchmarks.bfcl import (
    BfclTask,
    evaluate_bfcl,
    load_bfcl,
    run_bfcl,
    score_bfcl,
)
from spade_jax.evaluation.tool_benchmarks.common import (
    CallableUser,
    ScriptedUser,
    UserSimulator,
    parse_call_text,
    register_backend,
    suite_result,
)
from spade_jax.evaluation.tool_benchmarks.model_policy import (
    ModelToolPolicy,
    ModelUser,
    model_tool_policy,
)
from spade_jax.evaluation.tool_benchmarks.tau2 import (
    Tau2Domain,
    Tau2Task,
    evaluate_tau2,
    load_tau2_domain,
    load_tau2_tasks,
    run_tau2,
    score_tau2,
)

__all__ = [
    "AceTask", "BfclTask", "CallableUser", "ModelToolPolicy", "ModelUser", "ScriptedUser",
    "Tau2Domain", "Tau2Task", "UserSimulator", "evaluate_acebench", "evaluate_bfcl",
    "evaluate_tau2", "load_acebench", "load_bfcl", "load_tau2_domain", "load_tau2_tasks",
    "model_tool_policy", "parse_call_text", "register_backend", "run_acebench", "run_bfcl",
    "run_tau2", "score_acebench", "score_bfcl", "score_tau2", "suite_result",
]
