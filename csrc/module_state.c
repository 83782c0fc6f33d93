/* module_state.c: where every file of rlhfz._C finds the module's state.
 *
 * rlhfz keeps its types and its in-flight borrows in module state, not in C
 * globals. These two lookups live apart from module.c, which registers
 * everything, so that no file has to call up into the module's init. */
#include "rlhfz_module.h"

rlhfz_state *rlhfz_get_state(PyObject *module)
{
    return (rlhfz_state *)PyModule_GetState(module);
}

rlhfz_state *rlhfz_state_from_type(PyTypeObject *type)
{
    return (rlhfz_state *)PyType_GetModuleState(type);
}
