"""Built-in passes, one module per family; each module registers its passes on import.

Adding a pass is adding a module here (or a class to a family module): fusectl imports every
module of this package, so there is no central list to edit.
"""
