"""The typed table of rendezvous options is the one description of them.

* docs/adapters.md's table of options, and docs/agent.md's of what each backend does
  with each key, are the ones rendered from the table (``RALLYPOINT_UPDATE_DOCS=1``
  rewrites them);
* the options that set the core's settings are its fields, and their defaults
  are its defaults;
* each type has one coercion, and a bad value gets that type's message;
* the launcher's keys that it sets from flags are the table's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from rallypoint.adapters import options
from rallypoint.adapters.options import COERCE, SETTING, TABLE, ConfigError, coerce, option
from rallypoint.agent import config as agent_config
from rallypoint.agent.config import LaunchConfig
from rallypoint.agent.launcher import build_parser
from rallypoint.core import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    ("page", "render"),
    [
        ("adapters.md", options.render_docs_table),
        ("agent.md", agent_config.render_rdzv_conf_table),
    ],
)
def test_the_docs_tables_of_options_are_rendered_from_the_table(
    page: str, render: Callable[[], str]
) -> None:
    path = DOCS / page
    text = path.read_text()
    rendered = options.replace_table(text, render())
    if os.environ.get("RALLYPOINT_UPDATE_DOCS") and rendered != text:
        path.write_text(rendered)
        text = rendered
    assert text == rendered, (
        f"docs/{page}'s table of options is not the table's: rerun this test with "
        "RALLYPOINT_UPDATE_DOCS=1"
    )


def test_a_text_without_the_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no table of options"):
        options.replace_table("# nothing here\n", options.render_docs_table())


def test_the_settings_options_are_the_core_settings_fields_with_their_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    settings = {o.name for o in TABLE if o.setting}
    # The identity and the sizes come from the parameters; the rollback is not an option.
    assert settings == set(fields) - {"run_id", "min_nodes", "max_nodes", "rollback_period"}
    assert all(option(name).default is SETTING for name in settings)
    assert all(o.setting for o in TABLE if o.default is SETTING)
    assert options.settings_values({}) == {name: fields[name].default for name in settings}
    # The launcher's flag for a setting starts from the same default (the launcher
    # does not load the core to read it: its checks run before anything else loads).
    default = fields["exclusion_rounds"].default
    assert LaunchConfig(1, 1, 1).exclusion_rounds == default
    if "PET_EXCLUSION_ROUNDS" not in os.environ:
        assert build_parser().get_default("exclusion_rounds") == default


def test_every_option_is_well_formed() -> None:
    assert len({o.name for o in TABLE}) == len(TABLE)
    for o in TABLE:
        assert o.ours or o.torch, o.name
        assert o.type in COERCE or (o.type == "torch" and not o.ours), o.name
        assert bool(o.choices) == (o.type == "choice"), o.name
        if o.type == "choice":
            assert o.default in o.choices, o.name
        if o.alias_of is not None:
            assert option(o.alias_of).ours == o.ours and o.type == option(o.alias_of).type
        assert not o.ours or o.alias_of or o.doc, o.name


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [
        ("is_host", "yes", True),
        ("is_host", " Off ", False),
        ("is_host", False, False),
        ("stable_ranks", "1", True),
        ("read_timeout", "5", 5.0),
        ("join_timeout", 2.5, 2.5),
        ("keep_alive_max_attempt", "3", 3),
        ("restart_budget", "none", None),
        ("restart_budget", "", None),
        ("restart_budget", "2", 2),
        ("store_type", " FILE", "file"),
        ("protocol", "HTTPS", "https"),
        ("local_addr", "h", "h"),
    ],
)
def test_each_type_reads_its_values(name: str, given: object, expected: object) -> None:
    assert coerce(name, {name: given}) == expected


@pytest.mark.parametrize(
    ("name", "given", "message"),
    [
        ("is_host", "maybe", "rendezvous option is_host='maybe' is not a boolean (use true"),
        ("read_timeout", "abc", "rendezvous option read_timeout='abc' is not a number of sec"),
        ("ttl", "0", "rendezvous option ttl must be more than 0 and at most 604800 seconds"),
        ("join_timeout", "inf", "join_timeout must be more than 0"),
        ("keep_alive_max_attempt", "1.5", "keep_alive_max_attempt='1.5' is not an integer"),
        ("restart_budget", "x", "restart_budget='x' is not an integer"),
        ("store_type", "disk", "rendezvous option store_type='disk': use tcp or file"),
        ("protocol", "ftp", "rendezvous option protocol='ftp': use http or https"),
        ("cacert", "/nonexistent/ca.pem", "cacert='/nonexistent/ca.pem': not a readable file"),
    ],
)
def test_a_bad_value_gets_its_types_message(name: str, given: object, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        if option(name).setting:
            options.settings_values({name: given})
        else:
            coerce(name, {name: given})
    assert message in str(raised.value)


def test_an_option_not_given_takes_its_default() -> None:
    assert coerce("read_timeout", {}) == 60.0
    assert coerce("store_type", {}) == "tcp"
    assert coerce("ttl", {}) is None and coerce("is_host", {}) is None


@pytest.mark.parametrize("backend", sorted(agent_config.BACKEND_IMPLEMENTATIONS))
def test_the_launcher_never_hands_on_a_key_it_sets_from_a_flag(backend: str) -> None:
    flagged = {o.name for o in TABLE if o.flag}
    assert flagged == {"local_addr", "restart_budget", "exclusion_rounds", "rank"}
    assert not agent_config.rdzv_options_read(backend) & flagged
