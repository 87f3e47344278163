"""A corpus of bad inputs, tried as a new user or a hostile client would (the reliability
issue's categories). Each case: what is sent, the status expected over HTTP, and words the
error message must hold (the field it names, and the fix).

`SPECS` go as the request spec (HTTP: in `vllm_xargs` of /v1/completions; offline: in
SamplingParams); `VECTORS` as a body of POST /v1/hook/vectors (offline: register_vectors);
`HOOKS` as a body of POST /v1/hook/hooks/register; `HTTP` are raw requests (HTTP only).
Test servers run the tiny 4-layer, 128-wide model with max_model_len 512.
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np

H = 128
GOOD = [0.01] * H
B64 = base64.b64encode(np.ones(H, np.float32).tobytes()).decode()


def _add(**kw) -> dict:
    return {"steer": [{"op": "add", "layer": 0, "vector": GOOD, **kw}]}


def _cap(**kw) -> dict:
    return {"capture": [{"layers": [0], **kw}]}


FIX = "Fix:"
# name: (spec, status, words the message must contain)
SPECS: dict[str, tuple] = {
    # -- the spec's shape
    "unknown_top_field": ({"capture": [], "stear": []}, 400, ["unknown field 'stear'", FIX]),
    "unknown_capture_field": ({"capture": [{"layer": 0}]}, 400, ["capture[0]", "unknown field 'layer'"]),
    "unknown_steer_field": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD, "vec": 1}]}, 400,
                            ["steer[0]", "unknown field 'vec'"]),
    "capture_not_list": ({"capture": {"layers": [0]}}, 400, ["capture", "list of capture items"]),
    "steer_not_list": ({"steer": "add"}, 400, ["steer", "list of steering ops"]),
    "spec_list": ([1, 2], 400, ["expected an object", FIX]),
    "spec_number": ("42", 400, ["expected an object"]),
    "spec_null": ("null", 400, ["expected an object"]),
    "spec_string": ('"capture"', 400, ["expected an object"]),
    "spec_nan_literal": ("NaN", 400, ["expected an object"]),
    "malformed_open": ('{"capture": [', 400, ["malformed JSON", FIX]),
    "malformed_unquoted": ("{capture: []}", 400, ["malformed JSON"]),
    "malformed_single_quotes": ("{'capture': []}", 400, ["malformed JSON"]),
    "malformed_trailing_comma": ('{"capture": [],}', 400, ["malformed JSON"]),
    "malformed_extra_data": ('{"capture": []}{', 400, ["malformed JSON"]),
    "empty_string": ("", 400, ["malformed JSON"]),
    "nested_top": ("[" * 10000 + "]" * 10000, 400, ["nested too deeply", FIX]),
    "nested_field": ('{"capture": [{"layers": ' + "[" * 10000 + "]" * 10000 + "}]}", 400,
                     ["nested too deeply"]),
    "nested_objects": ('{"capture": [' + '{"a":' * 5000 + "1" + "}" * 5000 + "]}", 400,
                       ["nested too deeply"]),
    # -- layers
    "layer_out_of_range": (_cap(layers=[4]), 400, ["capture[0].layers[0]", "out of range for a 4-layer model"]),
    "layer_negative_out_of_range": (_cap(layers=[-5]), 400, ["capture[0].layers[0]", "out of range"]),
    "layer_bool": (_cap(layers=[True]), 400, ["capture[0].layers[0]", "expected an integer"]),
    "layer_float": (_cap(layers=[1.0]), 400, ["capture[0].layers[0]", "expected an integer"]),
    "layer_string": (_cap(layers=["0"]), 400, ["capture[0].layers[0]", "expected an integer"]),
    "layer_null": (_cap(layers=[None]), 400, ["capture[0].layers[0]", "expected an integer"]),
    "layers_word": (_cap(layers="first"), 400, ["capture[0].layers", "integer layer index"]),
    "layers_object": (_cap(layers={}), 400, ["capture[0].layers", "integer layer index"]),
    "layers_empty": (_cap(layers=[]), 400, ["capture[0].layers", "empty layer list"]),
    "layer_1e30": (_cap(layers=[1e30]), 400, ["capture[0].layers[0]", "expected an integer"]),
    "layer_2_pow_63": (_cap(layers=[2 ** 63]), 400, ["capture[0].layers[0]", "out of range"]),
    "layer_minus_2_pow_63": (_cap(layers=[-2 ** 63]), 400, ["capture[0].layers[0]", "out of range"]),
    # -- token selectors
    "position_before_start": (_cap(tokens=[-1000]), 400, ["capture[0].tokens[0]", "before the start"]),
    "position_past_max_model_len": (_cap(tokens=[600]), 400, ["capture[0].tokens", "max_model_len"]),
    "position_1e30": (_cap(tokens=[1e30]), 400, ["capture[0].tokens[0]", "expected an integer"]),
    "position_2_pow_63": (_cap(tokens=[2 ** 63]), 400, ["capture[0].tokens", "max_model_len"]),
    "position_bool": (_cap(tokens=[True]), 400, ["capture[0].tokens[0]", "expected an integer"]),
    "position_half": (_cap(tokens=[0.5]), 400, ["capture[0].tokens[0]", "expected an integer"]),
    "position_string": (_cap(tokens=["1"]), 400, ["capture[0].tokens[0]", "expected an integer"]),
    "selector_unknown": (_cap(tokens="firstish"), 400, ["capture[0].tokens", "last_prompt"]),
    "selector_object": (_cap(tokens={}), 400, ["capture[0].tokens", "last_prompt"]),
    "steer_position_past_max_model_len": (_add(tokens=[2 ** 40]), 400, ["steer[0].tokens", "max_model_len"]),
    "steer_position_1e30": (_add(tokens=[1e30]), 400, ["steer[0].tokens[0]", "expected an integer"]),
    "steer_selector_unknown": (_add(tokens="everything"), 400, ["steer[0].tokens", "last_prompt"]),
    # -- sites and heads
    "site_unknown": (_cap(site="resid_mid"), 400, ["capture[0].site", "resid_post"]),
    "site_number": (_cap(site=3), 400, ["capture[0].site", "resid_post"]),
    "attn_scores_generated": ({"capture": [{"layers": [0], "site": "attn_scores", "tokens": "generated"}]}, 400,
                              ["capture[0].tokens", "prompt tokens"]),
    "heads_on_residual": (_cap(heads=[0]), 400, ["capture[0].heads", "remove heads"]),
    "heads_out_of_range": ({"capture": [{"layers": [0], "site": "q", "heads": [99]}]}, 400,
                           ["capture[0].heads", "99"]),
    "heads_bad_layer_key": ({"capture": [{"layers": [0], "site": "q", "heads": {"x": [0]}}]}, 400,
                            ["capture[0].heads", FIX]),
    "heads_string": ({"capture": [{"layers": [0], "site": "q", "heads": "some"}]}, 400,
                     ["capture[0].heads", "head indices"]),
    "dtype_unknown": ({"capture": [{"layers": [0]}], "dtype": "float64"}, 400, ["dtype", "float32"]),
    "save_over_http": ({"save": {"dir": "/tmp/x"}, "capture": [{"layers": [0]}]}, 400,
                       ["save", "not available over HTTP"]),
    "save_path_traversal": ({"save": {"dir": "../../etc"}, "capture": [{"layers": [0]}]}, 400,
                            ["save", "not available over HTTP"]),
    # -- steering ops
    "op_unknown": ({"steer": [{"op": "shift", "layer": 0, "vector": GOOD}]}, 400, ["steer[0]", '"add"']),
    "op_missing": ({"steer": [{"layer": 0, "vector": GOOD}]}, 400, ["steer[0]", '"add"']),
    "layer_missing": ({"steer": [{"op": "add", "vector": GOOD}]}, 400, ["steer[0].layer", "required"]),
    "vector_missing": ({"steer": [{"op": "add", "layer": 0}]}, 400, ["steer[0].vector", "required"]),
    "steer_layer_out_of_range": (_add(layer=4), 400, ["steer[0].layer", "out of range"]),
    "steer_layer_string": (_add(layer="0"), 400, ["steer[0].layer", "expected an integer"]),
    "scale_string": (_add(scale="2"), 400, ["steer[0].scale", "expected a number"]),
    "scale_bool": (_add(scale=True), 400, ["steer[0].scale", "expected a number"]),
    "scale_nan": (_add(scale=math.nan), 400, ["steer[0].scale", "finite"]),
    "scale_inf": (_add(scale=math.inf), 400, ["steer[0].scale", "finite"]),
    "scale_minus_inf": (_add(scale=-math.inf), 400, ["steer[0].scale", "finite"]),
    "scale_overflowing": (_add(scale=1e39), 400, ["steer[0]", "exceeds"]),
    "scale_huge_finite": (_add(scale=1e30), 400, ["steer[0]", "exceeds"]),
    "cap_min_over_max": ({"steer": [{"op": "cap", "layer": 0, "vector": GOOD, "min": 2.0, "max": 1.0}]}, 400,
                         ["steer[0]", "greater than max"]),
    "cap_without_bounds": ({"steer": [{"op": "cap", "layer": 0, "vector": GOOD}]}, 400,
                           ["steer[0]", "min, max or both"]),
    "cap_bound_overflowing": ({"steer": [{"op": "cap", "layer": 0, "vector": GOOD, "max": 1e38}]}, 400,
                              ["steer[0]", "exceeds"]),
    "cap_bound_nan": ({"steer": [{"op": "cap", "layer": 0, "vector": GOOD, "max": math.nan}]}, 400,
                      ["steer[0].max", "NaN", "finite"]),
    "cap_min_plus_inf": ({"steer": [{"op": "cap", "layer": 0, "vector": GOOD, "min": math.inf}]}, 400,
                         ["steer[0]", "no projection lies within", "finite bounds"]),
    # as JSON text: offline, vLLM itself refuses a dict holding an integer beyond int64
    "scale_integer_beyond_float": (json.dumps(_add(scale=0)).replace('"scale": 0', '"scale": 1' + "0" * 400), 400,
                                   ["steer[0].scale", "too large", "finite number"]),
    "norm_match_string": (_add(norm_match="yes"), 400, ["steer[0].norm_match", "true or false"]),
    "ablate_scale_overflowing": ({"steer": [{"op": "ablate", "layer": 0, "vector": GOOD, "scale": 1e35}]}, 400,
                                 ["steer[0]", "exceeds"]),
    "too_many_ops_at_a_layer": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD}] * 3}, 400,
                                ["steer[2].layer", "max_ops_per_layer"]),
    # -- vectors
    "vector_wrong_size": (_add(vector=[1.0] * 12), 400, ["steer[0].vector", "expected 128 values"]),
    "vector_empty": (_add(vector=[]), 400, ["steer[0].vector", "expected 128 values"]),
    "vector_nan": (_add(vector=[math.nan] * H), 400, ["steer[0].vector", "NaN"]),
    "vector_inf": (_add(vector=[math.inf] + [1.0] * (H - 1)), 400, ["steer[0].vector", "infinite"]),
    "vector_beyond_float32": (_add(vector=[1e39] + [1.0] * (H - 1)), 400, ["steer[0].vector", "float32's range"]),
    "vector_overflowing_norm": (_add(vector=[3e38] * H), 400, ["steer[0]", "exceeds"]),
    "vector_zero_for_ablate": ({"steer": [{"op": "ablate", "layer": 0, "vector": [0.0] * H}]}, 400,
                               ["steer[0].vector", "zero norm"]),
    "vector_2d": (_add(vector=[GOOD]), 400, ["steer[0].vector", "1-D"]),
    "vector_strings": (_add(vector=["a"] * H), 400, ["steer[0].vector", FIX]),
    "vector_bools": (_add(vector=[True] * H), 400, ["steer[0].vector", "got booleans"]),
    "vector_mixed": (_add(vector=[1.0] * (H - 1) + ["x"]), 400, ["steer[0].vector", "numbers"]),
    "vector_number": (_add(vector=5), 400, ["steer[0].vector", FIX]),
    "vector_b64_garbage": (_add(vector={"b64": "###", "dtype": "float32"}), 400, ["steer[0].vector", "base64"]),
    "vector_b64_wrong_length": (_add(vector={"b64": B64[:-8], "dtype": "float32"}), 400, ["steer[0].vector", FIX]),
    "vector_b64_bad_dtype": (_add(vector={"b64": B64, "dtype": "int8"}), 400, ["steer[0].vector", "float32"]),
    "vector_b64_extra_key": (_add(vector={"b64": B64, "dtype": "float32", "scale": 2}), 400,
                             ["steer[0].vector", FIX]),
    "vector_b64_not_string": (_add(vector={"b64": 12, "dtype": "float32"}), 400, ["steer[0].vector", FIX]),
    "vector_unknown_name": (_add(vector="no_such"), 404, ["steer[0].vector", "no registered vector named 'no_such'"]),
    "vector_name_too_long": (_add(vector="v" * 300), 404, ["steer[0].vector", "no registered vector"]),
    # -- hooks in the spec
    "hook_pickle_without_client_code": ({"hooks": [{"pickle": base64.b64encode(b"x").decode()}]}, 400,
                                        ["hooks[0]", "allow_client_code"]),
    "hook_unknown_operator": ({"hooks": [{"name": "nope"}]}, 400, ["hooks[0]", "no operator hook named 'nope'"]),
    "hook_name_number": ({"hooks": [{"name": 5}]}, 400, ["hooks[0]", FIX]),
    "hook_args_not_object": ({"hooks": [{"name": "stream_norms", "args": [1]}]}, 400, ["hooks[0]", FIX]),
    "hook_item_string": ({"hooks": ["stream_norms"]}, 400, ["hooks[0]", FIX]),
    # -- sizes
    "too_many_capture_items": ({"capture": [{"layers": [0]}] * 1025}, 400, ["capture", "1024", FIX]),
    "too_many_list_entries": ({"capture": [{"layers": [0], "tokens": list(range(500))}] * 132}, 400,
                              ["more than 65536 in all", FIX]),
    "spec_too_long": (_add(vector=[0.5] * 2_200_000), 400, ["more than a spec may hold", "b64"]),
    "capture_bytes_over_the_limit": ({"capture": [{"layers": "all", "tokens": "all"},
                                                  {"layers": "all", "site": "resid_pre", "tokens": "all"}]}, 400,
                                     ["max_capture_bytes_per_request", "lower max_tokens"]),
}
# The capture-bytes case runs with max_tokens 500 against a server with a 1 MiB limit
# (2 sites x 4 layers x 511 rows x 512 bytes = 2 MiB).
BIG_MAX_TOKENS = {"capture_bytes_over_the_limit": 500}
# Over HTTP against the test server (request bodies limited to 1 MiB), a long spec meets the
# body limit first: (status, words).
HTTP_STATUS = {"spec_too_long": (413, ["max_request_bytes"])}

# name: (body, status, words)
VECTORS: dict[str, tuple] = {
    "vectors_wrong_size": ({"v": [1.0] * 12}, 400, ["vectors['v']", "expected 128 values"]),
    "vectors_nan": ({"v": [math.nan] * H}, 400, ["vectors['v']", "NaN"]),
    "vectors_beyond_float32": ({"v": [1e39] * H}, 400, ["vectors['v']", "float32's range"]),
    "vectors_bools": ({"v": [False] * H}, 400, ["vectors['v']", "booleans"]),
    "vectors_bad_name": ({"bad name!": GOOD}, 400, ["invalid vector name", "A-Z"]),
    "vectors_long_name": ({"v" * 200: GOOD}, 400, ["invalid vector name"]),
    "vectors_name_as_value": ({"v": "other"}, 400, ["cannot be registered as another name"]),
    "vectors_b64_garbage": ({"v": {"b64": "%%%", "dtype": "float32"}}, 400, ["vectors['v']", "base64"]),
    "vectors_2d": ({"v": [[1.0] * H]}, 400, ["vectors['v']", "1-D"]),
}

# (method, path, kwargs for httpx, status, words); kwargs may hold "auth": False
HTTP: dict[str, tuple] = {
    "completions_malformed_json": ("POST", "/v1/completions", {"content": b'{"model": ', "json_type": True}, 400, []),
    "xargs_nested_object": ("POST", "/v1/completions", {"xargs": {"vllm_hook": {"capture": []}}}, 400, []),
    "xargs_number": ("POST", "/v1/completions", {"xargs": {"vllm_hook": 5}}, 400, ["expected an object"]),
    "xargs_list": ("POST", "/v1/completions", {"xargs": {"vllm_hook": [1]}}, 400, []),
    "vectors_malformed_json": ("POST", "/v1/hook/vectors", {"content": b"{", "json_type": True}, 400,
                               ["not valid JSON"]),
    "vectors_not_object": ("POST", "/v1/hook/vectors", {"json": [1, 2]}, 400, ["non-empty JSON object"]),
    "vectors_empty_object": ("POST", "/v1/hook/vectors", {"json": {}}, 400, ["non-empty JSON object"]),
    "vectors_nested": ("POST", "/v1/hook/vectors",
                       {"content": b'{"v": ' + b"[" * 10000 + b"]" * 10000 + b"}", "json_type": True}, 400,
                       ["nested too deeply"]),
    "vectors_oversize": ("POST", "/v1/hook/vectors", {"json": {"v": [0.125] * 200_000}}, 413, ["max_request_bytes"]),
    "vectors_delete_unknown": ("DELETE", "/v1/hook/vectors/no_such", {}, 404, ["no_such"]),
    "hooks_register_malformed": ("POST", "/v1/hook/hooks/register", {"content": b"[", "json_type": True}, 400, []),
    "hooks_register_not_list": ("POST", "/v1/hook/hooks/register", {"json": {"hooks": "x"}}, 400, ["hooks"]),
    "hooks_register_unknown": ("POST", "/v1/hook/hooks/register", {"json": {"hooks": [{"name": "nope"}]}}, 400,
                               ["no operator hook named 'nope'"]),
    "hooks_register_pickle": ("POST", "/v1/hook/hooks/register",
                              {"json": {"hooks": [{"pickle": base64.b64encode(b"x").decode()}]}}, 400,
                              ["allow_client_code"]),
    "hooks_prefetch_unknown": ("POST", "/v1/hook/hooks/prefetch", {"json": {"names": ["no.such.weight"]}}, 400,
                               ["no.such.weight"]),
    "handle_traversal": ("GET", "/v1/hook/results/..%2F..%2Fetc%2Fpasswd", {}, 404, []),
    "handle_dotdot": ("GET", "/v1/hook/results/..", {}, 404, []),
    "handle_backslash": ("GET", "/v1/hook/results/a%5C..%5Cb", {}, 404, []),
    "handle_nul": ("GET", "/v1/hook/results/a%00b", {}, 404, []),
    "handle_long": ("GET", "/v1/hook/results/" + "a" * 4000, {}, 404, []),
    "handle_delete_unknown": ("DELETE", "/v1/hook/results/nope", {}, 404, []),
    "handle_wrong_method": ("POST", "/v1/hook/results/nope", {}, 405, []),
    "unknown_route": ("GET", "/v1/hook/nope", {}, 404, []),
    "missing_api_key": ("GET", "/v1/hook/health", {"auth": False}, 401, []),
    "wrong_api_key": ("GET", "/v1/hook/health", {"auth": "wrong"}, 401, []),
    "missing_api_key_vectors": ("POST", "/v1/hook/vectors", {"auth": False, "json": {"v": GOOD}}, 401, []),
}


def counts() -> dict[str, int]:
    return {"specs": len(SPECS), "vector bodies": len(VECTORS), "raw HTTP": len(HTTP),
            "total": len(SPECS) + len(VECTORS) + len(HTTP)}
