"""`kvblend serve` request parsing: client chunks, the kvblend object, and every refusal as a 400
in OpenAI's error shape. Pure functions: no model, no server."""

from __future__ import annotations

import json

import pytest

from kvblend.serve.chunks import CHUNK_SEPARATOR, conversation, question_with_history, segments_report, split_blocks
from kvblend.serve.schema import ApiError, parse_body, parse_chat_request, parse_completion_request


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def refused(body: dict, param: str | None = None, code: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    err = info.value
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "code", "param"}
    if param is not None:
        assert err.param == param
    if code is not None:
        assert err.code == code
    return err


def test_plain_question_has_no_chunks():
    req = parse_chat_request(user("  Who built the Skua-7?  "))
    assert req.question == "Who built the Skua-7?" and req.chunks == []
    assert req.temperature == 0.0 and req.stream is False and req.store is True and req.top_k is None


def test_separator_blocks_are_chunks_and_the_last_is_the_question():
    text = f"Passage one.\n{CHUNK_SEPARATOR}\nPassage two.\n{CHUNK_SEPARATOR}\n\nWho?"
    req = parse_chat_request(user(text))
    assert req.chunks == ["Passage one.", "Passage two."] and req.question == "Who?"


def test_content_parts_are_chunks_and_the_last_part_is_the_question():
    parts = [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}, {"type": "text", "text": "Q?"}]
    req = parse_chat_request(user(parts))
    assert req.chunks == ["A.", "B."] and req.question == "Q?"


def test_system_and_developer_messages_become_the_system_prompt():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "No lists."},
                         {"role": "user", "content": "A.<<<chunk>>>Q?"}]}
    req = parse_chat_request(body)
    assert req.system == "Be brief.\n\nNo lists." and req.chunks == ["A."]


def test_earlier_turns_become_history_and_the_last_user_turn_carries_passages_and_question():
    body = {"messages": [{"role": "user", "content": "Hi.<<<chunk>>>There?"}, {"role": "assistant", "content": "Yes."},
                         {"role": "assistant", "content": None},
                         {"role": "user", "content": [{"type": "text", "text": "A."}, {"type": "text", "text": "Q?"}]}]}
    req = parse_chat_request(body)
    assert req.chunks == ["A."] and req.question == "Q?"
    assert req.history == [("user", "Hi.\nThere?"), ("assistant", "Yes.")]
    assert question_with_history(req.history, req.question).endswith("Now: Q?")
    assert "User: Hi." in question_with_history(req.history, req.question)


def test_stop_n_logprobs_and_vllm_extensions():
    body = {**user("Q?"), "stop": "END", "n": 3, "logprobs": True, "top_logprobs": 2, "ignore_eos": True,
            "min_tokens": 4, "max_tokens": 8, "presence_penalty": 0, "seed": 1}
    req = parse_chat_request(body)
    assert (req.stop, req.n, req.logprobs, req.top_logprobs, req.ignore_eos, req.min_tokens) == \
        (["END"], 3, True, 2, True, 4)
    assert parse_chat_request({**user("Q?"), "stop": ["a", "b", "a"]}).stop == ["a", "b"]


def test_a_legacy_completion_prompt_reads_like_a_user_message():
    req = parse_completion_request({"prompt": "P1.\n<<<chunk>>>\nQ?", "logprobs": 2, "max_tokens": 3})
    assert req.legacy and req.chunks == ["P1."] and req.question == "Q?" and req.top_logprobs == 2
    with pytest.raises(ApiError):
        parse_completion_request({"prompt": ["a", "b"]})


def test_json_nested_deeper_than_any_request_is_refused_before_parsing():
    with pytest.raises(ApiError) as info:
        parse_body(b'{"a":' * 1000 + b"1" + b"}" * 1000)
    assert info.value.code == "invalid_json"
    assert parse_body(b'{"messages": [{"content": "[[[[ not brackets ]]]]"}]}')["messages"]


def test_split_blocks_drops_empty_blocks():
    assert split_blocks(f"{CHUNK_SEPARATOR} a {CHUNK_SEPARATOR}{CHUNK_SEPARATOR} b ") == ["a", "b"]
    with pytest.raises(ValueError):
        conversation([], ["  ", CHUNK_SEPARATOR])


def test_sampling_and_kvblend_options():
    body = {**user("Q?"), "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}, "n": 1, "logprobs": False, "tools": None, "user": "u1",
            "kvblend": {"mode": "blend", "ratio": 0.2, "top_k": 2, "store": False}}
    req = parse_chat_request(body)
    assert (req.max_tokens, req.temperature, req.top_p, req.seed) == (7, 0.5, 0.9, 3)
    assert req.stream and req.include_usage
    assert (req.mode, req.ratio, req.top_k, req.docs, req.store) == ("blend", 0.2, 2, [], False)
    req = parse_chat_request({**user("Q?"), "kvblend": {"mode": "full", "docs": ["a.md"]}})
    assert (req.mode, req.ratio, req.docs) == ("full", None, ["a.md"])


def test_kvblend_options_that_would_have_no_effect_are_refused_as_the_cli_warns_of_them():
    """`{"mode": "full", "ratio": 0.5}` and `{"docs": [...], "top_k": 3}` answered 200 with the option dropped and no
    warning, where the schema promises to refuse what it cannot honour."""
    err = refused({**user("Q?"), "kvblend": {"mode": "full", "ratio": 0.5}}, param="kvblend.ratio")
    assert "no effect with kvblend.mode full" in err.message
    err = refused({**user("Q?"), "kvblend": {"docs": ["a.md"], "top_k": 3}}, param="kvblend.top_k")
    assert "nothing is retrieved" in err.message


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat_request({**user("Q?"), "max_tokens": 9, "max_completion_tokens": 3}).max_tokens == 3


@pytest.mark.parametrize("name,value", [("tools", [{"type": "function"}]), ("presence_penalty", 0.5),
                                        ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 1}),
                                        # 0 is a value, not an absence (0 == False in Python let these through)
                                        ("repetition_penalty", 0), ("best_of", 0), ("prompt_logprobs", 0),
                                        ("top_k", 0.0), ("best_of", True)])
def test_unsupported_parameters_are_refused_by_name(name, value):
    refused({**user("Q?"), name: value}, param=name, code="unsupported_parameter")


@pytest.mark.parametrize("name,value", [("presence_penalty", 0.0), ("frequency_penalty", 0), ("best_of", 1),
                                        ("repetition_penalty", 1.0), ("echo", False), ("tools", []),
                                        ("logit_bias", {}), ("suffix", None),
                                        # vLLM's extras at their defaults, which its clients send (were refused)
                                        ("top_k", -1), ("top_k", 0), ("min_p", 0), ("min_p", 0.0)])
def test_unsupported_parameters_at_their_neutral_value_are_accepted(name, value):
    assert parse_chat_request({**user("Q?"), name: value}).n == 1


@pytest.mark.parametrize("name,value", [("max_tokens", 0), ("max_tokens", "5"), ("max_tokens", True),
                                        ("temperature", 3), ("temperature", float("nan")), ("top_p", 0),
                                        ("seed", 2**64), ("stream", "yes"), ("model", 5)])
def test_bad_values_are_refused(name, value):
    refused({**user("Q?"), name: value}, param=name)


@pytest.mark.parametrize("options", [{"mode": "fast"}, {"ratio": 2}, {"top_k": -1}, {"docs": "a.md"},
                                     {"docs": [1]}, {"store": "no"}, {"nope": 1}])
def test_bad_kvblend_options_are_refused(options):
    refused({**user("Q?"), "kvblend": options})


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "assistant", "content": "x"}],
                                      [{"role": "user", "content": "Q?"}, {"role": "system", "content": "S"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                                      [{"role": "user", "content": 5}], [{"role": "user", "content": "   "}]])
def test_bad_messages_are_refused(messages):
    refused({"messages": messages}, param="messages")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies_are_400_invalid_json(raw):
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert json.loads(json.dumps(info.value.body()))["error"]["type"] == "invalid_request_error"


def test_segments_report_names_hits_and_computed_passages():
    from kvblend.pipeline.results import SegmentInfo

    infos = [SegmentInfo("k", None, 5, cached, stored=stored) for cached, stored in ((True, False), (True, True), (False, False))]
    sources = [s["source"] for s in segments_report(infos)]
    assert sources == ["hit", "computed", "computed"]


def test_top_k_zero_needs_passages_or_docs_and_says_so_without_cli_flags():
    err = refused({**user("Where?"), "kvblend": {"top_k": 0}}, param="kvblend")
    assert "--" not in err.message  # a client sets kvblend.top_k, not the CLI's --top-k
    assert parse_chat_request({**user(f"A passage.{CHUNK_SEPARATOR}Where?"), "kvblend": {"top_k": 0}}).top_k == 0
    assert parse_chat_request({**user("Where?"), "kvblend": {"top_k": 0, "docs": ["a.md"]}}).top_k == 0


def test_segments_report_says_where_each_passage_came_from():
    from kvblend.pipeline.results import SegmentInfo

    infos = [SegmentInfo("k1", "manual.pdf", 5, True, pages=[3, 3], section="Operating limits"),
             SegmentInfo("k2", None, 4, True, stored=True), SegmentInfo("k3", "parts.csv", 9, True, rows=[2, 26]),
             SegmentInfo("k4", "box.mbox", 7, True, section="Leak", sections=["Leak", "Re: Leak"])]
    first, second, third, fourth = segments_report(infos)
    assert first == {"key": "k1", "tokens": 5, "source": "hit", "document": "manual.pdf", "pages": [3, 3],
                     "section": "Operating limits", "sections": None, "rows": None}
    assert (fourth["section"], fourth["sections"]) == ("Leak", ["Leak", "Re: Leak"])  # every section it holds
    assert (second["document"], second["pages"], second["section"], second["rows"]) == (None, None, None, None)
    assert (third["document"], third["rows"]) == ("parts.csv", [2, 26])


@pytest.mark.parametrize("body,param,message", [
    ({"n": 9}, "n", "n must be at least 1 and at most 8"),
    ({"temperature": 3}, "temperature", "temperature must be between 0 and 2, not 3"),
    ({"kvblend": {"ratio": 2}}, "kvblend.ratio", "kvblend.ratio must be between 0 and 1, not 2"),
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage",
     "stream_options.include_usage must be a bool"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Q?"}, {"type": "image_url"}]}]},
     "messages", "messages[0].content[1]: only text parts are supported, not 'image_url'"),
    # a text part without text was "only text parts are supported, not 'text'"
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages", "messages[0].content[0].text must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages", "messages[0].content[0].text must be a string"),
])
def test_a_refusal_says_where_the_problem_is(body, param, message):
    """pydantic's error location becomes the refusal's wording and `param`; an array index stays in the message
    (the parameter is the top-level array, as OpenAI names it)."""
    err = refused({**user("Q?"), **body}, param=param)
    assert err.message == message
