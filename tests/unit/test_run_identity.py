"""`servedmodel run` names its process for kopf without asking the user database: under an arbitrary UID
(OpenShift's restricted-v2) getpass.getuser() raises, and the operator's pod exited at start
(tests/e2e/test_operator_pod.py runs it so)."""

from __future__ import annotations

import os

from servedmodel.handlers.run import name_this_process


def test_the_pods_name_is_the_identity() -> None:
    env = {"POD_NAME": "servedmodel-operator-abc"}
    name_this_process(env)
    assert env["POD_ID"] == "servedmodel-operator-abc"


def test_outside_a_pod_host_and_pid() -> None:
    env: dict[str, str] = {}
    name_this_process(env)
    assert env["POD_ID"].endswith(f"-{os.getpid()}")


def test_a_given_identity_stays() -> None:
    env = {"POD_ID": "mine", "POD_NAME": "pod"}
    name_this_process(env)
    assert env["POD_ID"] == "mine"
