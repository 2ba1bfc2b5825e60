"""sled-bench structured: what counts as a valid output, and each mode's draft policy."""

from bench.structured import EVENT, PERSON, TASKS, WEATHER_CALL, policy, valid


def test_an_output_is_valid_where_it_parses_and_fits_its_schema():
    assert valid('{"name": "Ann", "age": 40, "city": "Oslo"}', PERSON)
    assert not valid('{"name": "Ann", "age": 40}', PERSON)  # a required key missing
    assert not valid('{"name": "Ann", "age": "40", "city": "Oslo"}', PERSON)  # a string for an integer
    assert not valid('{"name": "Ann", "age": true, "city": "Oslo"}', PERSON)  # a boolean is no integer
    assert not valid('{"name": "Ann", "age": 40, "city": "Oslo", "x": 1}', PERSON)  # no other keys
    assert not valid('{"name": "Ann", "age": 40, "city": "Oslo"', PERSON)  # cut short
    assert valid('{"title": "sync", "day": "Friday", "hour": 9}', EVENT)
    assert not valid('{"title": "sync", "day": "Funday", "hour": 9}', EVENT)
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert valid(call, WEATHER_CALL) and not valid(call.replace("get_weather", "get_news"), WEATHER_CALL)


def test_each_mode_drafts_as_it_says():
    assert not policy("server-only", 6).drafts
    assert policy("SLED, drafts masked", 6).mask_drafts and not policy("SLED, drafts unmasked", 6).mask_drafts
    assert policy("SLED, masked + forced tokens", 6).forced_tokens and not policy("SLED, drafts masked", 6).forced_tokens
    assert not policy("SLED, drafts masked", 6).adaptive and policy("SLED, free text", 6).draft_tokens == 6
    assert all(len(prompts) >= 2 for _, prompts in TASKS.values())
