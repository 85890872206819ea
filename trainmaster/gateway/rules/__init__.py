"""What a party lets run on its data: the registry of named rules and the disclosure limits."""
