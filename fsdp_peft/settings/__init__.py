"""What a recipe says: its arguments and their keys, the choices each key takes, the model families and recipes
the project ships, the FSDP settings of an accelerate config, and activation checkpointing's forms.

`fsdp_peft.settings.config` reads a recipe YAML into `RecipeArguments`; the modules beside it own the names and
choices it checks against. Nothing here loads a model or touches a process group. Import from the module: this
package imports none of them.
"""
