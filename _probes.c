/* Timing probes in C: per-name accumulators of wall and thread CPU time.
 *
 * probes.py is the public face; this module only keeps the numbers. A Probes object owns
 * one accumulator per phase name; Probes.phase(name) makes a single-use context manager
 * whose enter/exit pair reads the clocks and updates the accumulator, all without Python
 * bytecode. probes.PythonProbes is the pure-Python twin and must give the same numbers.
 *
 * Nesting: each thread keeps a stack of its open phases. A phase entered while another
 * phase of the same name is open in the same thread is "nested": it is counted in
 * `nested` and adds no time, so a recursive name's total is the wall time it covers.
 *
 * The GIL is held throughout, which is what makes the accumulators thread-safe.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

/* ---- clocks ----------------------------------------------------------------------- */

/* Nanoseconds on a clock; CLOCK_MONOTONIC is the clock of time.perf_counter on Linux. */
static inline int64_t
clock_ns(clockid_t clock)
{
    struct timespec now;
    clock_gettime(clock, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* ---- Accumulator: the numbers of one name ------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *name;
    long long count;   /* outermost spans closed */
    long long nested;  /* spans closed inside an open span of the same name (same thread) */
    int64_t total_ns, min_ns, max_ns, cpu_ns;
} Accumulator;

static void
accumulator_zero(Accumulator *acc)
{
    acc->count = acc->nested = 0;
    acc->total_ns = acc->max_ns = acc->cpu_ns = 0;
    acc->min_ns = INT64_MAX;
}

static void
accumulator_dealloc(Accumulator *acc)
{
    Py_XDECREF(acc->name);
    PyObject_Free(acc);
}

static PyTypeObject AccumulatorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_probes.Accumulator",
    .tp_basicsize = sizeof(Accumulator),
    .tp_dealloc = (destructor)accumulator_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "The count and times of one phase name (internal).",
};

/* Seconds from nanoseconds, or None for an empty minimum/maximum. */
static PyObject *
seconds_or_none(int64_t ns, int empty)
{
    if (empty)
        Py_RETURN_NONE;
    return PyFloat_FromDouble((double)ns / 1e9);
}

/* The snapshot record of one accumulator: the same keys as probes.PythonProbes gives. */
static PyObject *
accumulator_record(Accumulator *acc)
{
    int empty = acc->count == 0;
    return Py_BuildValue(
        "{s:L,s:L,s:N,s:N,s:N,s:N}",
        "count", acc->count, "nested", acc->nested,
        "total_s", PyFloat_FromDouble((double)acc->total_ns / 1e9),
        "min_s", seconds_or_none(acc->min_ns, empty),
        "max_s", seconds_or_none(acc->max_ns, empty),
        "cpu_s", PyFloat_FromDouble((double)acc->cpu_ns / 1e9));
}

/* ---- OpenStack: the open phases of one thread ----------------------------------------- */

struct Phase;

/* Borrowed pointers: an open phase is kept alive by its with-statement, and removes
 * itself on exit (or on deallocation, if it was entered by hand and dropped). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t size, capacity;
    struct Phase **items;
} OpenStack;

static void
openstack_dealloc(OpenStack *stack)
{
    PyMem_Free(stack->items);
    PyObject_Free(stack);
}

static PyTypeObject OpenStackType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_probes.OpenStack",
    .tp_basicsize = sizeof(OpenStack),
    .tp_dealloc = (destructor)openstack_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "The open phases of one thread (internal).",
};

static PyObject *open_stack_key; /* key of the stack in each thread's state dict */

/* This thread's stack of open phases (borrowed), created on first use. It lives in the
 * thread state's dict, so it is freed with the thread. */
static OpenStack *
thread_open_stack(void)
{
    PyObject *thread_dict = PyThreadState_GetDict();
    if (thread_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_probes: no thread state dictionary");
        return NULL;
    }
    PyObject *found = PyDict_GetItemWithError(thread_dict, open_stack_key);
    if (found != NULL || PyErr_Occurred())
        return (OpenStack *)found;
    OpenStack *stack = PyObject_New(OpenStack, &OpenStackType);
    if (stack == NULL)
        return NULL;
    stack->size = stack->capacity = 0;
    stack->items = NULL;
    int failed = PyDict_SetItem(thread_dict, open_stack_key, (PyObject *)stack);
    Py_DECREF(stack); /* the thread dict owns it */
    return failed ? NULL : stack;
}

static int
openstack_push(OpenStack *stack, struct Phase *phase)
{
    if (stack->size == stack->capacity) {
        Py_ssize_t capacity = stack->capacity ? 2 * stack->capacity : 16;
        struct Phase **items = PyMem_Realloc(stack->items, capacity * sizeof(*items));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        stack->items = items;
        stack->capacity = capacity;
    }
    stack->items[stack->size++] = phase;
    return 0;
}

/* Remove a phase, searching from the top: exits are last-in first-out except around
 * generators suspended inside a phase. */
static void
openstack_remove(OpenStack *stack, struct Phase *phase)
{
    for (Py_ssize_t i = stack->size - 1; i >= 0; i--) {
        if (stack->items[i] == phase) {
            memmove(&stack->items[i], &stack->items[i + 1],
                    (stack->size - i - 1) * sizeof(stack->items[0]));
            stack->size--;
            return;
        }
    }
}

/* ---- Probes and Phase ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *accumulators; /* dict: name -> Accumulator, in order of first use */
    PyObject *decorate;     /* callable(phase, function) -> wrapper, or NULL */
    PyObject *device_timer; /* callable(name, device) -> stop callable or None, or NULL */
} Probes;

typedef struct Phase {
    PyObject_HEAD
    Probes *owner;
    Accumulator *acc;
    PyObject *device;      /* NULL when none was given */
    PyObject *device_stop; /* what device_timer returned for the open span, or NULL */
    OpenStack *stack;      /* the entering thread's stack while open, else NULL */
    PyThreadState *thread; /* the entering thread */
    int nested;
    int64_t wall_start, cpu_start;
} Phase;

static PyTypeObject PhaseType;

static void
phase_dealloc(Phase *self)
{
    if (self->stack != NULL) { /* entered by hand and dropped: forget the span */
        openstack_remove(self->stack, self);
        Py_DECREF(self->stack);
    }
    Py_XDECREF(self->device_stop);
    Py_XDECREF(self->device);
    Py_DECREF(self->acc);
    Py_DECREF(self->owner);
    PyObject_Free(self);
}

/* The accumulator of a name, created (zeroed) on first use. New reference. */
static Accumulator *
find_accumulator(Probes *probes, PyObject *name)
{
    PyObject *found = PyDict_GetItemWithError(probes->accumulators, name);
    if (found != NULL) {
        Py_INCREF(found);
        return (Accumulator *)found;
    }
    if (PyErr_Occurred())
        return NULL;
    Accumulator *acc = PyObject_New(Accumulator, &AccumulatorType);
    if (acc == NULL)
        return NULL;
    Py_INCREF(name);
    acc->name = name;
    accumulator_zero(acc);
    if (PyDict_SetItem(probes->accumulators, name, (PyObject *)acc) < 0) {
        Py_DECREF(acc);
        return NULL;
    }
    return acc;
}

/* Whether a phase of the same accumulator is already open in this stack. */
static int
is_open_in(OpenStack *stack, Accumulator *acc)
{
    for (Py_ssize_t i = 0; i < stack->size; i++)
        if (stack->items[i]->acc == acc)
            return 1;
    return 0;
}

static PyObject *
phase_enter(Phase *self, PyObject *Py_UNUSED(ignored))
{
    if (self->stack != NULL)
        return PyErr_Format(PyExc_RuntimeError,
                            "probes.phase(%R) is already open; make a new probes.phase(...) "
                            "for each with-block", self->acc->name);
    OpenStack *stack = thread_open_stack();
    if (stack == NULL)
        return NULL;
    self->nested = is_open_in(stack, self->acc);
    if (openstack_push(stack, self) < 0)
        return NULL;
    Py_INCREF(stack);
    self->stack = stack;
    self->thread = PyThreadState_Get();
    /* a nested span of the same name adds no time, device time included */
    if (self->device != NULL && self->owner->device_timer != NULL && !self->nested) {
        PyObject *stop = PyObject_CallFunctionObjArgs(self->owner->device_timer, self->acc->name,
                                                      self->device, NULL);
        if (stop == NULL) {
            openstack_remove(stack, self);
            Py_CLEAR(self->stack);
            return NULL;
        }
        if (stop == Py_None)
            Py_DECREF(stop);
        else
            self->device_stop = stop;
    }
    if (!self->nested) {
        /* wall first and CPU last (the reverse on exit): the CPU span lies inside the wall
         * span, so cpu_s never exceeds total_s */
        self->wall_start = clock_ns(CLOCK_MONOTONIC);
        self->cpu_start = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

/* Add one closed span to the accumulator. */
static void
accumulate(Accumulator *acc, int nested, int64_t wall_ns, int64_t cpu_ns)
{
    if (nested) {
        acc->nested++;
        return;
    }
    acc->count++;
    acc->total_ns += wall_ns;
    acc->cpu_ns += cpu_ns;
    if (wall_ns < acc->min_ns)
        acc->min_ns = wall_ns;
    if (wall_ns > acc->max_ns)
        acc->max_ns = wall_ns;
}

static PyObject *
phase_exit(Phase *self, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs))
{
    int64_t wall_ns = 0, cpu_ns = 0;
    if (self->stack == NULL)
        return PyErr_Format(PyExc_RuntimeError, "probes.phase(%R) exited without being entered",
                            self->acc->name);
    if (!self->nested) {
        /* another thread's CPU clock says nothing about this span: add no CPU time */
        if (PyThreadState_Get() == self->thread)
            cpu_ns = clock_ns(CLOCK_THREAD_CPUTIME_ID) - self->cpu_start;
        wall_ns = clock_ns(CLOCK_MONOTONIC) - self->wall_start;
    }
    openstack_remove(self->stack, self);
    Py_CLEAR(self->stack);
    accumulate(self->acc, self->nested, wall_ns, cpu_ns);
    if (self->device_stop != NULL) {
        PyObject *stop = self->device_stop;
        self->device_stop = NULL;
        PyObject *result = PyObject_CallNoArgs(stop);
        Py_DECREF(stop);
        if (result == NULL)
            return NULL;
        Py_DECREF(result);
    }
    Py_RETURN_FALSE; /* never swallow the exception of the body */
}

/* Used as a decorator: the owner's decorate hook makes the wrapper. */
static PyObject *
phase_call(Phase *self, PyObject *args, PyObject *kwargs)
{
    if (self->owner->decorate == NULL)
        return PyErr_Format(PyExc_TypeError, "this Probes object has no decorate hook; "
                            "decorate through the probes module");
    PyObject *function;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "a phase decorates one function; no keywords");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "phase", 1, 1, &function))
        return NULL;
    return PyObject_CallFunctionObjArgs(self->owner->decorate, (PyObject *)self, function, NULL);
}

static PyObject *
phase_repr(Phase *self)
{
    return PyUnicode_FromFormat("<probes phase %R%s>", self->acc->name,
                                self->stack != NULL ? " (open)" : "");
}

static PyObject *
phase_get_name(Phase *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->acc->name);
}

static PyObject *
phase_get_device(Phase *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->device != NULL ? self->device : Py_None);
}

static PyObject *
phase_get_owner(Phase *self, void *Py_UNUSED(closure))
{
    return Py_NewRef((PyObject *)self->owner);
}

static PyMethodDef phase_methods[] = {
    {"__enter__", (PyCFunction)phase_enter, METH_NOARGS, "Start the clocks."},
    {"__exit__", (PyCFunction)(void (*)(void))phase_exit, METH_FASTCALL,
     "Stop the clocks and add the span to its name; exceptions pass through."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef phase_getset[] = {
    {"name", (getter)phase_get_name, NULL, "The phase name.", NULL},
    {"device", (getter)phase_get_device, NULL, "The device given, or None.", NULL},
    {"owner", (getter)phase_get_owner, NULL, "The Probes object that keeps its numbers.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_probes.Phase",
    .tp_basicsize = sizeof(Phase),
    .tp_dealloc = (destructor)phase_dealloc,
    .tp_repr = (reprfunc)phase_repr,
    .tp_call = (ternaryfunc)phase_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_doc = "One timed span: a single-use context manager, or a decorator.",
    .tp_methods = phase_methods,
    .tp_getset = phase_getset,
};

static PyTypeObject ProbesType;

/* Probes.phase(name, device=None): a new, closed phase of that name. */
static PyObject *
probes_phase(Probes *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char usage[] = "phase(name, device=None)";
    PyObject *name = NULL, *device = Py_None;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < 1 || nargs + nkw > 2 || (nkw == 1 && nargs == 2))
        return PyErr_Format(PyExc_TypeError, "%s takes a name and an optional device", usage);
    name = args[0];
    if (nargs == 2)
        device = args[1];
    else if (nkw == 1) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "device") != 0)
            return PyErr_Format(PyExc_TypeError, "%s got an unexpected keyword %R", usage,
                                PyTuple_GET_ITEM(kwnames, 0));
        device = args[1];
    }
    if (!PyUnicode_Check(name))
        return PyErr_Format(PyExc_TypeError, "a phase name must be a str, not %.100s",
                            Py_TYPE(name)->tp_name);
    Accumulator *acc = find_accumulator(self, name);
    if (acc == NULL)
        return NULL;
    Phase *phase = PyObject_New(Phase, &PhaseType);
    if (phase == NULL) {
        Py_DECREF(acc);
        return NULL;
    }
    Py_INCREF(self);
    phase->owner = self;
    phase->acc = acc;
    phase->device = device == Py_None ? NULL : Py_NewRef(device);
    phase->device_stop = NULL;
    phase->stack = NULL;
    phase->thread = NULL;
    phase->nested = 0;
    phase->wall_start = phase->cpu_start = 0;
    return (PyObject *)phase;
}

/* Probes.snapshot(): {name: {count, nested, total_s, min_s, max_s, cpu_s}} of every
 * name with a closed span since the last reset, in order of first use. */
static PyObject *
probes_snapshot(Probes *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *result = PyDict_New();
    PyObject *name, *value;
    Py_ssize_t position = 0;
    if (result == NULL)
        return NULL;
    while (PyDict_Next(self->accumulators, &position, &name, &value)) {
        Accumulator *acc = (Accumulator *)value;
        if (acc->count == 0 && acc->nested == 0)
            continue;
        PyObject *record = accumulator_record(acc);
        if (record == NULL || PyDict_SetItem(result, name, record) < 0) {
            Py_XDECREF(record);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(record);
    }
    return result;
}

/* Probes.reset(): forget every closed span. Spans open now are recorded when they close. */
static PyObject *
probes_reset(Probes *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *name, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(self->accumulators, &position, &name, &value))
        accumulator_zero((Accumulator *)value);
    Py_RETURN_NONE;
}

/* A hook given as None is no hook. New reference or NULL. */
static PyObject *
hook_or_null(PyObject *hook, const char *what)
{
    if (hook == NULL || hook == Py_None)
        return NULL;
    if (!PyCallable_Check(hook)) {
        PyErr_Format(PyExc_TypeError, "Probes(%s=...): expected a callable or None", what);
        return NULL;
    }
    return Py_NewRef(hook);
}

static PyObject *
probes_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"decorate", "device_timer", NULL};
    PyObject *decorate = NULL, *device_timer = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OO:Probes", keywords, &decorate, &device_timer))
        return NULL;
    Probes *self = (Probes *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->accumulators = PyDict_New();
    self->decorate = hook_or_null(decorate, "decorate");
    if (self->decorate == NULL && PyErr_Occurred())
        goto failed;
    self->device_timer = hook_or_null(device_timer, "device_timer");
    if (self->accumulators == NULL || PyErr_Occurred())
        goto failed;
    return (PyObject *)self;
failed:
    Py_DECREF(self);
    return NULL;
}

static int
probes_traverse(Probes *self, visitproc visit, void *arg)
{
    Py_VISIT(self->accumulators);
    Py_VISIT(self->decorate);
    Py_VISIT(self->device_timer);
    return 0;
}

static int
probes_clear(Probes *self)
{
    Py_CLEAR(self->accumulators);
    Py_CLEAR(self->decorate);
    Py_CLEAR(self->device_timer);
    return 0;
}

static void
probes_dealloc(Probes *self)
{
    PyObject_GC_UnTrack(self);
    probes_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef probes_methods[] = {
    {"phase", (PyCFunction)(void (*)(void))probes_phase, METH_FASTCALL | METH_KEYWORDS,
     "phase(name, device=None): a timed span, as a with-block or a decorator."},
    {"snapshot", (PyCFunction)probes_snapshot, METH_NOARGS,
     "{name: {count, nested, total_s, min_s, max_s, cpu_s}} since the last reset."},
    {"reset", (PyCFunction)probes_reset, METH_NOARGS, "Forget every closed span."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ProbesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_probes.Probes",
    .tp_basicsize = sizeof(Probes),
    .tp_dealloc = (destructor)probes_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Probes(*, decorate=None, device_timer=None): a set of per-name accumulators.",
    .tp_traverse = (traverseproc)probes_traverse,
    .tp_clear = (inquiry)probes_clear,
    .tp_methods = probes_methods,
    .tp_new = probes_new,
};

/* ---- module ---------------------------------------------------------------------- */

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_probes",
    .m_doc = "Timing probes in C; use the probes module, which falls back to Python without it.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__probes(void)
{
    if (PyType_Ready(&AccumulatorType) < 0 || PyType_Ready(&OpenStackType) < 0 ||
        PyType_Ready(&PhaseType) < 0 || PyType_Ready(&ProbesType) < 0)
        return NULL;
    if (open_stack_key == NULL) {
        /* one key per loaded copy of this library: two builds in one process (a test's
         * fresh build beside the in-place one) must never share a stack */
        open_stack_key = PyUnicode_FromFormat("_probes.open_stack.%p", (void *)&OpenStackType);
        if (open_stack_key == NULL)
            return NULL;
    }
    PyObject *module = PyModule_Create(&probes_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Probes", (PyObject *)&ProbesType) < 0 ||
        PyModule_AddObjectRef(module, "Phase", (PyObject *)&PhaseType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
