"""Built-in backend plugins. Each registers through attnreg's hooks via an entry point."""
