"""The extensions: each a file that imports the core and plugs in through one seam
(``trainer.Parts``, a config, a pool); the core never imports them. docs/extensions.md lists
them, the seam each overrides, and the flags that switch them on."""
