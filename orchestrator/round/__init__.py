"""The round: one turn's draft -> score -> verify -> commit loop (loop), its steps and hooks, the
session record's lifecycle in Redis (sessions), statistics (stats), text in and out (text) and the
grammar of structured output (grammar)."""
