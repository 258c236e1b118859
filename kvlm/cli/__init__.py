"""The `kvlm` command (`commands.main`): generate, chat, serve, pull, inspect, perplexity, bench."""
