"""Every sampling setting declared in ``request/settings.py`` reaches every surface: the request
parser (OpenAI bodies, OIP and Triton parameters), OIP's string parameters, the Triton model's
inputs, and ``kiln generate``'s options."""

from __future__ import annotations

import numpy as np
import pytest

from modelkiln.generation.request.params import sampling_params
from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.request.settings import SETTINGS, from_command_line, from_tensor
from modelkiln.serve.generation.oip import sampling_fields
from modelkiln.triton.generation import INPUTS

# A value of each setting as a request sends it, and what SamplingParams then holds.
EXAMPLES = {
    "max_tokens": (7, ("max_new_tokens", 7)),
    "temperature": (0.5, ("temperature", 0.5)),
    "top_k": (9, ("top_k", 9)),
    "top_p": (0.8, ("top_p", 0.8)),
    "min_p": (0.05, ("min_p", 0.05)),
    "repetition_penalty": (1.2, ("repetition_penalty", 1.2)),
    "frequency_penalty": (0.4, ("frequency_penalty", 0.4)),
    "presence_penalty": (-0.3, ("presence_penalty", -0.3)),
    "logit_bias": ({"11": 2.5}, ("logit_bias", ((11, 2.5),))),
    "seed": (2**40 + 3, ("seed", 2**40 + 3)),
    "stop": (["\n\n", "END"], ("stop", ("\n\n", "END"))),
    "stop_token_ids": ([5, 6], ("stop_token_ids", (5, 6))),
    "ignore_eos": (True, ("ignore_eos", True)),
}


def parsed(fields: dict) -> SamplingParams:
    return sampling_params(fields, SamplingParams(), prompt_tokens=4, max_context=64)


def test_every_setting_has_an_example():
    assert set(EXAMPLES) == {s.name for s in SETTINGS}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_the_request_parser_reads_every_setting(setting):
    value, (field, expected) = EXAMPLES[setting.name]
    assert getattr(parsed({setting.name: value}), field) == expected


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_oip_parameters_carry_every_setting(setting):
    """OIP parameters as tritonclient's gRPC sends them: a float as a string, the rest as they are."""
    value, (field, expected) = EXAMPLES[setting.name]
    sent = str(value) if setting.kind == "float" else value
    assert getattr(parsed(sampling_fields({setting.name: sent})), field) == expected


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_the_triton_model_has_an_input_for_every_setting(setting):
    """An input of the setting's name and type, and its tensor read back as the request field."""
    spec = next(i for i in INPUTS if i.name == setting.name)
    assert spec.optional and spec.data_type == setting.triton_type
    value, (field, expected) = EXAMPLES[setting.name]
    if setting.kind == "bias":
        tensor = np.array(['{"11": 2.5}'.encode()], dtype=object)
    elif setting.kind == "strings":
        tensor = np.array([v.encode() for v in value], dtype=object)
    else:
        tensor = np.array(value if setting.listed else [value])
    assert getattr(parsed({setting.name: from_tensor(setting, tensor.reshape(-1).tolist())}), field) == expected


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_the_command_line_form_of_every_setting(setting):
    value, (field, expected) = EXAMPLES[setting.name]
    given = ["11:2.5"] if setting.kind == "bias" else value
    assert getattr(parsed({setting.name: from_command_line(setting, given)}), field) == expected
