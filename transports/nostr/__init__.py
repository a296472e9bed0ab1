"""The Nostr transport: a D4 (DDIP-001) worker on nostr-sdk (see docs/protocols/d4-nostr.md)."""
