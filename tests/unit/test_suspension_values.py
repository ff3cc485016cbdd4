"""A suspension names host fields without white space (issue 17: "gmail .com" was taken)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.policyfile import load_suspensions_file
from sluice.scheduler.policy import PolicyError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field", ["recipientdomain", "remotemx", "remoteip", "localip"])
def test_a_host_field_with_spaces_is_refused_naming_file_and_key(tmp_path: Path,
                                                                 field: str) -> None:
    path = tmp_path / "suspensions.yaml"
    path.write_text(f"- {field}: 'gmail .com'\n  reason: typo\n")
    with pytest.raises(PolicyError) as info:
        load_suspensions_file(str(path))
    assert str(info.value) == f"{path}: [0].{field}: 'gmail .com' is not a {field}: it has spaces"


def test_a_well_formed_suspension_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "suspensions.yaml"
    path.write_text("- recipientdomain: gmail.com\n  tenantid: acme\n")
    (susp,) = load_suspensions_file(str(path))
    assert susp.fields == (("recipientdomain", "gmail.com"), ("tenantid", "acme"))
