"""What a new user of the HTTP API sees first: create's answer, and seeds that stay numbers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

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


async def test_seed_is_a_number_where_json_holds_it_exactly(client: httpx.AsyncClient) -> None:
    sid = (await client.post("/v1/sessions", json={})).json()["id"]
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "Hi"})
    cases = [
        (7, 7),
        ("42", 42),
        (2**53, 2**53),
        (2**53 + 1, str(2**53 + 1)),
        (2**64 - 1, str(2**64 - 1)),
    ]
    for given, shown in cases:
        r = await client.post(
            f"/v1/sessions/{sid}/generate", json={"max_tokens": 1, "seed": given, "stream": False}
        )
        assert r.status_code == 200, r.text
        assert r.json()["generation"]["params"]["seed"] == shown, given
    doc = (await client.get(f"/v1/sessions/{sid}")).json()
    assert [g["params"]["seed"] for g in doc["generations"]] == [shown for _, shown in cases]
    assert type(doc["generations"][0]["params"]["seed"]) is int
