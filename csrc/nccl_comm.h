/* nccl_comm.h: the NcclComm type (nccl_comm.c), a communicator whose
 * collectives take rlhfz borrows. The NCCL ABI and the library it calls are
 * in nccl_library.h. */
#ifndef RLHFZ_NCCL_COMM_H
#define RLHFZ_NCCL_COMM_H

#include "rlhfz_module.h"

/* Adds the NcclComm type to the module (rlhfz_nccl_library_add first: a
 * communicator takes its library from the module). */
int rlhfz_nccl_comm_add_type(PyObject *module);

#endif /* RLHFZ_NCCL_COMM_H */
