"""The gateway service: the mapping table, the party links, the relay of results, its routes."""
