"""The data side: text and shards in, ``(B, T)`` GPT-2 token windows out."""
