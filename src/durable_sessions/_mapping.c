/*
 * durable_sessions._mapping: map_attributes (durable_sessions/mapping.py) in C, for the
 * common span.
 *
 * The Python function is the reference. Every front end maps each span through it: the
 * sidecar for every span it receives, the span processor for every action span. In
 * CPython its attribute loop and the steps after it cost a few microseconds a span, a
 * large share of what the sidecar spends on one. Mapper does the same steps in C for
 * the spans almost all instrumentation sends, and hands every other span, untouched, to
 * the reference:
 *
 * - attributes and resource plain dicts, attribute names plain strings;
 * - agent.action.* values plain str, bool, float, int within 64 bits, or tuples of them
 *   (anything exact() would convert, and an integer OTLP cannot carry, goes to Python);
 * - the project's own convention, agent.action.kind present; without it only spans no
 *   third-party convention recognises (the Python _convention decides), which are no
 *   action or an action without kind;
 * - a result that is a JSON string orjson reads, the redacted placeholder, and holds no
 *   run of 19 digits (an integer orjson may read inexactly: exact_integers' case);
 * - a given result_digest that is a non-empty string, when a result is recorded;
 * - session id, incarnation and name fall-backs that are plain scalars.
 *
 * A declined span costs the C work done so far and nothing else: the record is built
 * in a new dict, and no input is changed. The Python helpers the mapping shares with
 * other code (span_time, prompt_digest, digest_value, _convention) are called, not
 * copied.
 *
 * tests/test_mapping_native.py checks that Mapper and the reference give the same
 * record (keys, order, values and their types) and problems for generated spans.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <string.h>

static PyObject *F_KIND, *F_RESULT, *F_STATUS, *F_PROMPT, *F_PROMPT_DIGEST, *F_RESULT_LENGTH,
    *F_VALUE_LIMIT, *F_REDACTED, *F_RESULT_DIGEST, *F_SESSION_ID, *F_SESSION_SOURCE, *F_INCARNATION,
    *F_NAME, *F_SEQ, *F_TS, *TRACE_FORMAT, *ONE_E9, *ZERO, *DECLINED;

/* The Python objects a Mapper holds, in one list so that each is taken, visited and
 * cleared alike. */
#define MAPPER_OBJECTS(X)  \
    X(reference)           \
    X(fields)              \
    X(prefix)              \
    X(session_keys)        \
    X(resource_session_key) \
    X(instance_key)        \
    X(name_keys)           \
    X(convention)          \
    X(not_action)          \
    X(redacted)            \
    X(status_ok)           \
    X(status_error)        \
    X(trace_source)        \
    X(loads)               \
    X(digest)              \
    X(prompt_digest)       \
    X(span_time)

typedef struct {
    PyObject_HEAD
#define DECLARE(name) PyObject *name;
    MAPPER_OBJECTS(DECLARE)
#undef DECLARE
    vectorcallfunc vectorcall;
} Mapper;

/* -- attribute values ------------------------------------------------------------------ */

/* A value of one of the four types the rules take as they are (not a subclass). */
static int
is_plain_scalar(PyObject *value)
{
    return PyUnicode_CheckExact(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value)
        || Py_IS_TYPE(value, &PyBool_Type);
}

/* A plain scalar OTLP can carry: an int must fit its signed 64 bits. */
static int
is_carried_scalar(PyObject *value)
{
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long n = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return !overflow;
    }
    return is_plain_scalar(value);
}

/* An agent.action.* value as the record holds it (a tuple as a list), as a new
 * reference; NULL (no error set) for a value the reference must judge. */
static PyObject *
record_value(PyObject *value)
{
    if (is_carried_scalar(value))
        return Py_NewRef(value);
    if (!PyTuple_CheckExact(value))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(value);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_carried_scalar(PyTuple_GET_ITEM(value, i)))
            return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        PyErr_Clear();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(list, i, Py_NewRef(PyTuple_GET_ITEM(value, i)));
    return list;
}

/* key.startswith(prefix), without a method call for the common one-byte key. */
static int
has_prefix(PyObject *key, PyObject *prefix)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(prefix);
    if (PyUnicode_KIND(key) == PyUnicode_1BYTE_KIND) /* the prefix is ASCII (Mapper_init) */
        return PyUnicode_GET_LENGTH(key) >= n && memcmp(PyUnicode_DATA(key), PyUnicode_DATA(prefix), n) == 0;
    return PyUnicode_Tailmatch(key, prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
}

static int
is_text(PyObject *value, PyObject *text)
{
    return value == text || (PyUnicode_CheckExact(value) && PyUnicode_Compare(value, text) == 0);
}

/* The record's fields from the agent.action.* attributes, in the attributes' order;
 * *result gets agent.action.result (a new reference) when there is one. -1: decline. */
static int
read_own_fields(Mapper *self, PyObject *attributes, PyObject *record, PyObject **result)
{
    Py_ssize_t pos = 0, skip = PyUnicode_GET_LENGTH(self->prefix);
    PyObject *key, *value;
    while (PyDict_Next(attributes, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key))
            return -1;
        if (!has_prefix(key, self->prefix))
            continue;
        PyObject *plain = record_value(value);
        if (plain == NULL)
            return -1;
        PyObject *field = PyDict_GetItemWithError(self->fields, key); /* borrowed */
        if (field != NULL)
            Py_INCREF(field);
        else if (!PyErr_Occurred())
            field = PyUnicode_Substring(key, skip, PyUnicode_GET_LENGTH(key));
        int failed = field == NULL;
        if (!failed && is_text(field, F_RESULT)) {
            if (PyTuple_CheckExact(value)) /* a result that is no text: the reference reports it */
                failed = 1;
            else
                Py_XSETREF(*result, Py_NewRef(value));
        }
        else if (!failed)
            failed = PyDict_SetItem(record, field, plain) < 0;
        Py_XDECREF(field);
        Py_DECREF(plain);
        if (failed)
            return -1;
    }
    return 0;
}

/* -- the result ------------------------------------------------------------------------ */

/* Whether JSON text may hold an integer orjson reads inexactly: a run of 19 digits
 * anywhere, or a digit first. More than json_text.may_hold_long_integer finds; the
 * reference reads those again. */
static int
may_hold_long_integer(PyObject *text)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < '0' || c > '9')
            run = 0;
        else if (++run >= 19 || i == 0)
            return 1;
    }
    return 0;
}

static int
set_field(PyObject *record, PyObject *field, PyObject *value)
{
    if (value == NULL)
        return -1;
    int failed = PyDict_SetItem(record, field, value);
    Py_DECREF(value);
    return failed;
}

/* _own_result for JSON text: the parsed result (a new reference), with result_length,
 * value_limit and redacted set; NULL to decline. */
static PyObject *
own_result(Mapper *self, PyObject *record, PyObject *value, PyObject *limit)
{
    if (!PyUnicode_CheckExact(value))
        return NULL;
    if (set_field(record, F_RESULT_LENGTH, PyLong_FromSsize_t(PyUnicode_GET_LENGTH(value))) < 0)
        return NULL;
    if (limit != Py_None && PyDict_SetItem(record, F_VALUE_LIMIT, limit) < 0)
        return NULL;
    if (is_text(value, self->redacted))
        return PyDict_SetItem(record, F_REDACTED, Py_True) < 0 ? NULL : Py_NewRef(value);
    if (may_hold_long_integer(value))
        return NULL;
    PyObject *parsed = PyObject_CallOneArg(self->loads, value);
    if (parsed == NULL)
        return NULL;
    if (is_text(parsed, self->redacted) && PyDict_SetItem(record, F_REDACTED, Py_True) < 0)
        Py_CLEAR(parsed);
    return parsed;
}

/* The tail's handling of a result: result_digest checked, then the result or its
 * digest recorded. -1: decline. */
static int
record_result(Mapper *self, PyObject *record, PyObject *result, int keep)
{
    PyObject *given = PyDict_GetItemWithError(record, F_RESULT_DIGEST);
    int redacted = PyDict_GetItemWithError(record, F_REDACTED) == Py_True;
    if (PyErr_Occurred())
        return -1;
    if (given != NULL && !redacted && !(PyUnicode_CheckExact(given) && PyUnicode_GET_LENGTH(given) > 0))
        return -1; /* malformed: the reference drops it and says why */
    if (keep)
        return PyDict_SetItem(record, F_RESULT, result);
    if (redacted || given != NULL)
        return 0;
    return set_field(record, F_RESULT_DIGEST, PyObject_CallOneArg(self->digest, result));
}

/* -- the span's other parts ------------------------------------------------------------ */

/* mapping.get(key) where exact() keeps it as it is: 1 with *value (borrowed) set, 0 when
 * it is missing or None, -1 to decline (a value exact() would convert). */
static int
scalar_at(PyObject *mapping, PyObject *key, PyObject **value)
{
    *value = PyDict_GetItemWithError(mapping, key);
    if (*value == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (*value == Py_None)
        return 0;
    return is_plain_scalar(*value) ? 1 : -1;
}

/* _first(mapping, keys): as scalar_at, for the first of keys with a value. */
static int
first_of(PyObject *mapping, PyObject *keys, PyObject **value)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
        int found = scalar_at(mapping, PyTuple_GET_ITEM(keys, i), value);
        if (found != 0)
            return found;
    }
    return 0;
}

static int
set_session(Mapper *self, PyObject *record, PyObject *attributes, PyObject *resource, PyObject *trace_id)
{
    PyObject *session_id;
    int found = first_of(attributes, self->session_keys, &session_id);
    if (found == 0)
        found = scalar_at(resource, self->resource_session_key, &session_id);
    if (found != 0)
        return found < 0 ? -1 : PyDict_SetItem(record, F_SESSION_ID, session_id);
    PyObject *hex = PyUnicode_CheckExact(trace_id) ? Py_NewRef(trace_id) : PyObject_Format(trace_id, TRACE_FORMAT);
    if (set_field(record, F_SESSION_ID, hex) < 0)
        return -1;
    return PyDict_SetItem(record, F_SESSION_SOURCE, self->trace_source);
}

/* seq and ts from span_time; *problem is its problem (a new reference) or NULL. */
static int
set_time(Mapper *self, PyObject *record, PyObject *start, PyObject *end, PyObject **problem)
{
    *problem = NULL;
    PyObject *time_ns = start, *pair = NULL;
    int dated = PyLong_CheckExact(start) ? PyObject_IsTrue(start) : 0;
    if (!dated) { /* span_time's own words for a span without a start time */
        PyObject *args[2] = {start, end};
        pair = PyObject_Vectorcall(self->span_time, args, 2, NULL);
        if (pair == NULL || !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_XDECREF(pair);
            return -1;
        }
        time_ns = PyTuple_GET_ITEM(pair, 0);
        if (PyTuple_GET_ITEM(pair, 1) != Py_None)
            *problem = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
    }
    int failed = 0;
    if (time_ns != Py_None)
        failed = PyDict_SetItem(record, F_SEQ, time_ns) < 0
              || set_field(record, F_TS, PyNumber_TrueDivide(time_ns, ONE_E9)) < 0;
    Py_XDECREF(pair);
    if (failed)
        Py_CLEAR(*problem);
    return failed ? -1 : 0;
}

/* -- the mapping ----------------------------------------------------------------------- */

/* Everything of the record that the result and the span's parts decide, after the
 * attribute loop (map_attributes from its "status" step on). */
static int
complete_record(Mapper *self, PyObject *record, PyObject *result, PyObject *const *args)
{
    PyObject *attributes = args[0], *resource = args[1];
    if (!PyDict_Contains(record, F_STATUS)) {
        int error = PyObject_IsTrue(args[2]);
        if (error < 0 || PyDict_SetItem(record, F_STATUS, error ? self->status_error : self->status_ok) < 0)
            return -1;
    }
    PyObject *prompt = PyDict_GetItemWithError(record, F_PROMPT);
    if (prompt != NULL && !PyDict_Contains(record, F_PROMPT_DIGEST)
        && set_field(record, F_PROMPT_DIGEST, PyObject_CallOneArg(self->prompt_digest, prompt)) < 0)
        return -1;
    int keep = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred() || keep < 0 || (result != NULL && record_result(self, record, result, keep) < 0))
        return -1;
    if (!PyDict_Contains(record, F_SESSION_ID) && set_session(self, record, attributes, resource, args[4]) < 0)
        return -1;
    PyObject *value;
    int found = scalar_at(resource, self->instance_key, &value);
    if (found < 0 || (found && PyDict_SetItem(record, F_INCARNATION, value) < 0))
        return -1;
    if (PyDict_Contains(record, F_NAME))
        return 0;
    found = first_of(attributes, self->name_keys, &value);
    return found < 0 || (found && PyDict_SetItem(record, F_NAME, value) < 0) ? -1 : 0;
}

/* Whether a span without agent.action.kind is one the C path maps: no third-party
 * convention recognises it as an action. 1 yes, 0 decline. */
static int
no_convention(Mapper *self, PyObject *attributes)
{
    PyObject *convention = PyObject_CallOneArg(self->convention, attributes);
    if (convention == NULL)
        return 0;
    int none = convention == Py_None || convention == self->not_action;
    Py_DECREF(convention);
    return none;
}

/* (record, problems), None (no action), or NULL with no error set: declined. */
static PyObject *
map_fast(Mapper *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *attributes = args[0], *resource = args[1], *limit = args[6];
    if (!PyDict_CheckExact(attributes) || !PyDict_CheckExact(resource)
        || !(limit == Py_None || PyLong_CheckExact(limit)))
        return NULL;
    PyObject *record = PyDict_New(), *result = NULL, *problem = NULL, *out = NULL;
    if (record == NULL || read_own_fields(self, attributes, record, &result) < 0)
        goto done;
    int has_kind = PyDict_Contains(record, F_KIND);
    if (has_kind < 0)
        goto done;
    if (has_kind && result != NULL) {
        Py_SETREF(result, own_result(self, record, result, limit));
        if (result == NULL)
            goto done;
    }
    else if (!has_kind) { /* a result stays as it was given, as the reference keeps it */
        if (!no_convention(self, attributes))
            goto done;
        if (PyDict_GET_SIZE(record) == 0 && result == NULL) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    if (complete_record(self, record, result, args) < 0
        || set_time(self, record, args[3], nargs > 8 ? args[8] : ZERO, &problem) < 0)
        goto done;
    PyObject *problems = problem == NULL ? PyTuple_New(0) : PyTuple_Pack(1, problem);
    if (problems != NULL) {
        out = PyTuple_Pack(2, record, problems);
        Py_DECREF(problems);
    }
done:
    Py_XDECREF(record);
    Py_XDECREF(result);
    Py_XDECREF(problem);
    if (out == NULL)
        PyErr_Clear();
    return out;
}

/* -- Mapper ---------------------------------------------------------------------------- */

/* map_attributes(...): the C path, else the reference with the same arguments. */
static PyObject *
Mapper_vectorcall(Mapper *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && (nargs == 8 || nargs == 9)) {
        PyObject *mapped = map_fast(self, args, nargs);
        if (mapped != NULL)
            return mapped;
    }
    return PyObject_Vectorcall(self->reference, args, nargsf, kwnames);
}

static PyObject *
Mapper_attempt(Mapper *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (self->vectorcall == NULL) {
        PyErr_SetString(PyExc_TypeError, "Mapper was not initialised");
        return NULL;
    }
    if (nargs != 8 && nargs != 9) {
        PyErr_Format(PyExc_TypeError, "attempt() takes map_attributes' 8 or 9 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *mapped = map_fast(self, args, nargs);
    return mapped != NULL ? mapped : Py_NewRef(DECLINED);
}

static int
Mapper_init(Mapper *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
#define NAME(name) #name,
        MAPPER_OBJECTS(NAME)
#undef NAME
        NULL,
    };
    PyObject *given[17];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O$OOOOOOOOOOOOOOOO:Mapper", keywords, &given[0],
                                     &given[1], &given[2], &given[3], &given[4], &given[5], &given[6],
                                     &given[7], &given[8], &given[9], &given[10], &given[11], &given[12],
                                     &given[13], &given[14], &given[15], &given[16]))
        return -1;
    int i = 0;
#define TAKE(name) Py_XSETREF(self->name, Py_NewRef(given[i++]));
    MAPPER_OBJECTS(TAKE)
#undef TAKE
    if (!PyDict_CheckExact(self->fields) || !PyTuple_CheckExact(self->session_keys)
        || !PyTuple_CheckExact(self->name_keys) || !PyUnicode_CheckExact(self->prefix)
        || !PyUnicode_IS_ASCII(self->prefix)) {
        PyErr_SetString(PyExc_TypeError,
                        "Mapper: fields must be a dict, session_keys and name_keys tuples, prefix ASCII text");
        return -1;
    }
    self->vectorcall = (vectorcallfunc)Mapper_vectorcall;
    return 0;
}

static int
Mapper_traverse(Mapper *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    MAPPER_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
Mapper_clear(Mapper *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    MAPPER_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Mapper_dealloc(Mapper *self)
{
    PyObject_GC_UnTrack(self);
    Mapper_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Called before __init__ has succeeded, a Mapper has nothing to map with: refuse rather
 * than crash. */
static PyObject *
Mapper_call(Mapper *self, PyObject *args, PyObject *kwargs)
{
    if (self->vectorcall == NULL) {
        PyErr_SetString(PyExc_TypeError, "Mapper was not initialised");
        return NULL;
    }
    return PyVectorcall_Call((PyObject *)self, args, kwargs);
}

static PyMethodDef Mapper_methods[] = {
    {"attempt", (PyCFunction)(void (*)(void))Mapper_attempt, METH_FASTCALL,
     "attempt(*map_attributes_arguments) -> what map_attributes returns, or DECLINED where the C "
     "path leaves the span to the reference."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durable_sessions._mapping.Mapper",
    .tp_basicsize = sizeof(Mapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "map_attributes(attributes, resource, status_error, start_time_ns, trace_id, span_id, limit, "
              "keep_result, end_time_ns=0): durable_sessions.mapping.map_attributes, in C for the common "
              "span and by the reference given for every other.",
    .tp_vectorcall_offset = offsetof(Mapper, vectorcall),
    .tp_call = (ternaryfunc)Mapper_call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mapper_init,
    .tp_traverse = (traverseproc)Mapper_traverse,
    .tp_clear = (inquiry)Mapper_clear,
    .tp_dealloc = (destructor)Mapper_dealloc,
    .tp_methods = Mapper_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions._mapping",
    .m_doc = "Optional native mapping of spans to action records (see durable_sessions.native).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__mapping(void)
{
    if (PyType_Ready(&MapperType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(F_KIND, "kind");
    INTERN(F_RESULT, "result");
    INTERN(F_STATUS, "status");
    INTERN(F_PROMPT, "prompt");
    INTERN(F_PROMPT_DIGEST, "prompt_digest");
    INTERN(F_RESULT_LENGTH, "result_length");
    INTERN(F_VALUE_LIMIT, "value_limit");
    INTERN(F_REDACTED, "redacted");
    INTERN(F_RESULT_DIGEST, "result_digest");
    INTERN(F_SESSION_ID, "session_id");
    INTERN(F_SESSION_SOURCE, "session_source");
    INTERN(F_INCARNATION, "incarnation");
    INTERN(F_NAME, "name");
    INTERN(F_SEQ, "seq");
    INTERN(F_TS, "ts");
    INTERN(TRACE_FORMAT, "032x");
#undef INTERN
    if ((ONE_E9 = PyFloat_FromDouble(1e9)) == NULL || (ZERO = PyLong_FromLong(0)) == NULL
        || (DECLINED = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Mapper", (PyObject *)&MapperType) < 0
        || PyModule_AddObjectRef(m, "DECLINED", DECLINED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
