"""Environments: the step-environment protocol (gymnasium API) and its built-ins.

Group (LLM-style) environments live in their own subpackage; this module only re-exports the step names.
"""

from __future__ import annotations

from rollhub.envs.step import EnvSpec, StepEnv, make_step_env

__all__ = ["EnvSpec", "StepEnv", "make_step_env"]
