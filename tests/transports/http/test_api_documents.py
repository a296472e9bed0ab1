"""The session document in the HTTP API's answers: create answers the whole document (as the
README shows), and a seed is an exact JSON integer in every answer while the log keeps digits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime

ROOT = Path(__file__).resolve().parents[3]


async def test_create_answers_the_whole_document_as_the_readme_says(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/sessions", json={})
    doc = r.json()
    assert r.status_code == 201 and r.headers["location"] == f"/v1/sessions/{doc['id']}"
    assert {"id", "status", "version", "history", "generations", "nodes"} <= set(doc)
    assert doc == (await client.get(f"/v1/sessions/{doc['id']}")).json()
    [line] = [
        x
        for x in (ROOT / "README.md").read_text().splitlines()
        if "-XPOST localhost:8080/v1/sessions -d" in x
    ]
    assert "session document" in line and not re.search(r'-> \{"id": "s_\.\.\."\}\s*$', line)


async def test_seed_is_an_integer_in_every_answer_and_exact_above_2_53(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    """Every answer shows the seed as a JSON integer, never a string, exact at any size
    (2**53 + 1 is where a double starts rounding); the log keeps its string of digits."""
    sid = (await client.post("/v1/sessions", json={})).json()["id"]
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "Hi"})
    seeds = [7, 42, 2**53, 2**53 + 1, 2**63 + 12345, 2**64 - 1]
    for seed in seeds:
        given: int | str = str(seed) if seed == 42 else seed  # the API takes digits too
        r = await client.post(
            f"/v1/sessions/{sid}/generate", json={"max_tokens": 1, "seed": given, "stream": False}
        )
        assert r.status_code == 200, r.text
        shown = r.json()["generation"]["params"]["seed"]
        assert type(shown) is int and shown == seed, (given, shown)
        # the JSON text has the digits themselves, not a float's rendering
        assert re.search(rf'"seed":\s*{seed}\b', r.text), r.text[:300]
    doc = (await client.get(f"/v1/sessions/{sid}")).json()
    assert [g["params"]["seed"] for g in doc["generations"]] == seeds
    assert all(type(g["params"]["seed"]) is int for g in doc["generations"])
    replay = json.loads((await client.get(f"/v1/sessions/{sid}/replay")).text)
    assert replay["base"]["generations"] == []
    started = [
        op["value"]["params"]["seed"]
        for step in replay["steps"]
        for op in step["patch"]
        if op["path"] == "/generations"
    ]
    assert started == seeds
    # the streamed document too (its snapshot holds the earlier generations)
    async with client.stream(
        "POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 1, "seed": 2**64 - 2}
    ) as r:
        text = (await r.aread()).decode()
    snapshot = json.loads(text.split("event: snapshot\ndata: ", 1)[1].split("\n", 1)[0])
    assert [g["params"]["seed"] for g in snapshot["generations"]][: len(seeds)] == seeds
    assert '"seed": 18446744073709551614' in text or '"seed":18446744073709551614' in text
    # the stored format is unchanged: a string of digits
    events = await runtime.log.read(sid)
    recorded = [e.body["params"]["seed"] for e in events if e.type == T.GENERATION_STARTED]
    assert recorded == [str(s) for s in [*seeds, 2**64 - 2]]
