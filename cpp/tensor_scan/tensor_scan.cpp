// shardadam._tensor_scan: what the optimizers read from every tensor on every
// step (.grad, data pointer, bytes, dtype) and the version-counter bump after
// a launch, in one C-level pass over a Python list ([Note: the tensor scan] in
// python/shardadam/_addresses.py says why). This is the one compiled file
// that includes torch's headers: it is built against the torch the build
// machine has, and the package uses it only under that same torch version
// (TORCH_VERSION below); the core (_core) never sees torch.
#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

namespace {

PyTypeObject* tensor_type = nullptr;  // torch._C.TensorBase, the base of every torch tensor

// The tensor at position i of a list, or nullptr with TypeError set. The
// list holds a reference to the object, so the borrowed tensor stays alive
// while the pass reads it (no refcount traffic per tensor).
const at::Tensor* tensor_at(PyObject* list, Py_ssize_t i) {
  PyObject* item = PyList_GET_ITEM(list, i);
  if (!PyObject_TypeCheck(item, tensor_type)) {
    PyErr_Format(PyExc_TypeError, "item %zd of the list is %s, not a tensor", i, Py_TYPE(item)->tp_name);
    return nullptr;
  }
  return &THPVariable_Unpack(item);
}

PyObject* list_arg(PyObject* arg) {
  if (!PyList_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "expected a list of tensors, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  return arg;
}

// records(tensors, sizes) -> bytes: per tensor its data pointer (what
// Tensor.data_ptr() returns) as an int64, followed, when sizes is true, by
// its size in bytes and its dtype code. Equal records mean equal pointers
// (and sizes and dtypes), so callers compare whole lists with bytes ==.
PyObject* records(PyObject*, PyObject* args) {
  PyObject* arg = nullptr;
  int sizes = 0;
  if (!PyArg_ParseTuple(args, "Op", &arg, &sizes) || !list_arg(arg)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(arg);
  const Py_ssize_t width = sizes ? 3 : 1;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * width * static_cast<Py_ssize_t>(sizeof(int64_t)));
  if (out == nullptr) return nullptr;
  auto* fields = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = tensor_at(arg, i);
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    c10::TensorImpl* impl = t->unsafeGetTensorImpl();
    try {
      // mutable_data, as Tensor.data_ptr(): the address a kernel writes at.
      fields[i * width] = reinterpret_cast<int64_t>(impl->mutable_data());
      if (sizes) {
        fields[i * width + 1] = impl->numel() * static_cast<int64_t>(impl->itemsize());
        fields[i * width + 2] = static_cast<int64_t>(impl->dtype().toScalarType());
      }
    } catch (const c10::Error& e) {  // no storage (sparse, wrapper subclasses): as data_ptr() raises
      Py_DECREF(out);
      PyErr_Format(PyExc_RuntimeError, "item %zd of the list: %s", i, e.what_without_backtrace());
      return nullptr;
    }
  }
  return out;
}

// bump(tensors): one version-counter increment per tensor, as an in-place
// torch op makes; an inference tensor has no counter and is passed over, as
// torch.autograd.graph.increment_version passes it over.
PyObject* bump(PyObject*, PyObject* arg) {
  if (!list_arg(arg)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(arg);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = tensor_at(arg, i);
    if (t == nullptr) return nullptr;
    c10::TensorImpl* impl = t->unsafeGetTensorImpl();
    if (!impl->is_inference()) impl->bump_version();
  }
  Py_RETURN_NONE;
}

// grads(params) -> list: each tensor's .grad (None where it has none), read
// from the tensors' C++ objects: what map(attrgetter("grad"), params) gives
// for tensors whose class does not override .grad (__torch_function__ is not
// consulted: the optimizers call this for plain tensors and Parameters only).
PyObject* grads(PyObject*, PyObject* arg) {
  if (!list_arg(arg)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(arg);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = tensor_at(arg, i);
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    const at::TensorBase& grad = t->grad();
    PyObject* item = grad.defined() ? THPVariable_Wrap(grad) : Py_NewRef(Py_None);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, item);
  }
  return out;
}

// grads_and_records(params) -> (list, bytes | None): grads(params), and the
// records(grads, True) of that list read in the same pass (each gradient's
// C++ object is at hand once its parameter's is), or None in its place when
// some parameter has no gradient or a gradient has no storage (sparse):
// FusedAdam's per-step read of its gradients in one pass instead of two.
PyObject* grads_and_records(PyObject*, PyObject* arg) {
  if (!list_arg(arg)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(arg);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  PyObject* record = PyBytes_FromStringAndSize(nullptr, n * 3 * static_cast<Py_ssize_t>(sizeof(int64_t)));
  if (record == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  auto* fields = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(record));
  bool complete = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = tensor_at(arg, i);
    if (t == nullptr) {
      Py_DECREF(out);
      Py_DECREF(record);
      return nullptr;
    }
    const at::TensorBase& grad = t->grad();
    if (!grad.defined()) {
      PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
      complete = false;
      continue;
    }
    PyObject* item = THPVariable_Wrap(grad);
    if (item == nullptr) {
      Py_DECREF(out);
      Py_DECREF(record);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, item);
    if (!complete) continue;
    c10::TensorImpl* impl = grad.unsafeGetTensorImpl();
    try {
      fields[i * 3] = reinterpret_cast<int64_t>(impl->mutable_data());  // as records()
      fields[i * 3 + 1] = impl->numel() * static_cast<int64_t>(impl->itemsize());
      fields[i * 3 + 2] = static_cast<int64_t>(impl->dtype().toScalarType());
    } catch (const c10::Error&) {  // no storage (sparse): where records() raises
      complete = false;
    }
  }
  if (!complete) {
    Py_DECREF(record);
    record = Py_NewRef(Py_None);
  }
  PyObject* result = PyTuple_Pack(2, out, record);
  Py_DECREF(out);
  Py_DECREF(record);
  return result;
}

PyMethodDef methods[] = {
    {"records", records, METH_VARARGS,
     "records(tensors: list, sizes: bool) -> bytes: each tensor's data pointer, and with sizes its bytes and "
     "dtype code, as int64s"},
    {"grads", grads, METH_O, "grads(tensors: list) -> list: each tensor's .grad, None where it has none"},
    {"grads_and_records", grads_and_records, METH_O,
     "grads_and_records(tensors: list) -> (list, bytes | None): grads(tensors) and records(that list, True), "
     "None for the records where a gradient is missing or has no storage"},
    {"bump", bump, METH_O, "bump(tensors: list) -> None: increment each tensor's version counter"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_scan",
                      "Tensor records and version bumps in one C-level pass (shardadam internal).", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__tensor_scan() {
  PyObject* torch_c = PyImport_ImportModule("torch._C");
  if (torch_c == nullptr) return nullptr;
  PyObject* base = PyObject_GetAttrString(torch_c, "TensorBase");
  Py_DECREF(torch_c);
  if (base == nullptr) return nullptr;
  if (!PyType_Check(base)) {
    Py_DECREF(base);
    PyErr_SetString(PyExc_ImportError, "torch._C.TensorBase is not a type");
    return nullptr;
  }
  tensor_type = reinterpret_cast<PyTypeObject*>(base);  // kept for the process's life
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", SHARDADAM_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
