/*
 * durable_sessions_collector.store._rows: the ActionRow of a plain mapped record, built
 * without the per-field Python of its reference.
 *
 * The reference is base.py's action_row: stored_record and checked_record (stored.py),
 * the columns, and encode_record. A receiver thread builds a row for every span, and that
 * Python held the GIL for a sixth of the sidecar's time. Rows.row does the same for a
 * record whose every stored field stored_record keeps as given, and returns None for any
 * other, so that the reference decides (and digests what it hides):
 *
 * - a record that is not exactly a dict, a field name that is not exactly a str;
 * - a stored field whose value is not exactly a str, bool, int within int64, float or
 *   None; a float that is not finite or that orjson writes otherwise than json does (a
 *   magnitude below smallest_float, base.py's _ORJSON_SMALLEST_FLOAT, but zero:
 *   encode_record writes it with json);
 * - an identifier longer than max_text characters, a digest that is not sha256: and 64
 *   hex digits of either case (durable_sessions.digest.sha256_digest), a value of a list
 *   field that is not one of its values, a string in a field of no text (a boolean or a
 *   number), all of which the reference stores as digests;
 * - text orjson refuses (a lone surrogate).
 *
 * Every value is then stored as given, so the checked record is the record itself (as
 * checked_record returns it when nothing differs), and the JSON text is orjson's, which
 * encode_record writes for such a record. collector/tests/store/test_rows_native.py holds
 * it to the reference over generated records: the same row, field for field, or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* What a stored field holds; a field from a list of values maps to that frozenset instead. */
enum { IDENTIFIER = 0, DIGEST = 1, NO_TEXT = 2 };

#define DIGEST_PREFIX "sha256:"
#define DIGEST_PREFIX_SIZE 7
#define DIGEST_SIZE (DIGEST_PREFIX_SIZE + 64)
/* ActionRow's fields in the order of its definition; Rows() checks the class has these. */
static const char *const ROW_FIELDS[] = {
    "session_id", "trace_id", "span_id", "status", "record", "action_id", "kind", "seq", "text",
};
#define ROW_SIZE ((Py_ssize_t)(sizeof(ROW_FIELDS) / sizeof(ROW_FIELDS[0])))
enum { SESSION_ID, TRACE_ID, SPAN_ID, STATUS, RECORD, ACTION_ID, KIND, SEQ, TEXT };

typedef struct {
    PyObject_HEAD
    PyObject *fields;          /* dict: stored field name -> IDENTIFIER/DIGEST/NO_TEXT or a frozenset */
    PyObject *row_type;        /* ActionRow */
    PyObject *slots[ROW_SIZE]; /* its member descriptors, set without running its __init__ */
    PyObject *names[ROW_SIZE]; /* their names, interned: the columns read from the stored record */
    PyObject *dumps;           /* orjson.dumps */
    PyObject *no_args;         /* () for the row type's tp_new */
    Py_ssize_t max_text;
    double smallest_float;     /* below it, zero aside, orjson writes a float otherwise than json */
} Rows;

/* --- which values are plain ---------------------------------------------------------- */

static int
well_formed_digest(PyObject *text)
{
    if (PyUnicode_GET_LENGTH(text) != DIGEST_SIZE || !PyUnicode_IS_ASCII(text))
        return 0;
    const char *chars = (const char *)PyUnicode_1BYTE_DATA(text);
    if (memcmp(chars, DIGEST_PREFIX, DIGEST_PREFIX_SIZE) != 0)
        return 0;
    for (Py_ssize_t i = DIGEST_PREFIX_SIZE; i < DIGEST_SIZE; i++) {
        char c = chars[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')))
            return 0;
    }
    return 1;
}

/* Whether stored_record keeps the string ``text`` of a field of ``kind`` as given; -1 with
 * an error set. Its test for a hidden form is not needed: a text accepted here is kept
 * as given whether it is one or not (an identifier up to max_text characters is kept in
 * either case, and no well-formed digest or listed value starts with hidden:sha256:). */
static int
plain_text(Rows *self, PyObject *kind, PyObject *text)
{
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (length == 0)
        return 1;
    if (PyFrozenSet_CheckExact(kind))
        return PySet_Contains(kind, text);
    switch (PyLong_AsLong(kind)) {
    case IDENTIFIER:
        return length <= self->max_text;
    case DIGEST:
        return well_formed_digest(text);
    default:
        return 0;
    }
}

/* Whether stored_record keeps ``value`` of a field of ``kind`` as given, and orjson
 * writes it as json does; -1 with an error set. */
static int
plain_value(Rows *self, PyObject *kind, PyObject *value)
{
    if (value == Py_None || PyBool_Check(value))
        return 1;
    if (PyUnicode_CheckExact(value))
        return plain_text(self, kind, value);
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (number == -1 && PyErr_Occurred())
            return -1;
        return overflow == 0;
    }
    if (PyFloat_CheckExact(value)) {
        double number = PyFloat_AS_DOUBLE(value);
        return number == 0.0 || (isfinite(number) && fabs(number) >= self->smallest_float);
    }
    return 0;
}

/* The stored record of ``record``: its stored fields, in its order (a new dict); None when
 * one is not plain; NULL with an error set. */
static PyObject *
stored_record(Rows *self, PyObject *record)
{
    PyObject *stored = PyDict_New();
    if (stored == NULL)
        return NULL;
    Py_ssize_t position = 0;
    PyObject *name, *value;
    while (PyDict_Next(record, &position, &name, &value)) {
        if (!PyUnicode_CheckExact(name))
            goto decline; /* a str subclass could run Python code in the lookup below */
        PyObject *kind = PyDict_GetItemWithError(self->fields, name);
        if (kind == NULL) {
            if (PyErr_Occurred())
                goto error;
            continue;
        }
        int plain = plain_value(self, kind, value);
        if (plain < 0)
            goto error;
        if (plain == 0)
            goto decline;
        if (PyDict_SetItem(stored, name, value) < 0)
            goto error;
    }
    return stored;
decline:
    Py_DECREF(stored);
    return Py_NewRef(Py_None);
error:
    Py_DECREF(stored);
    return NULL;
}

/* --- the row ----------------------------------------------------------------------- */

/* encode_record(stored): orjson's text; None (no error) where orjson refuses it. */
static PyObject *
encoded(Rows *self, PyObject *stored)
{
    PyObject *data = PyObject_CallOneArg(self->dumps, stored);
    if (data == NULL) {
        /* The reference then writes it with json, or raises: it decides. */
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    PyObject *text = NULL;
    if (PyBytes_Check(data))
        text = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), "strict");
    else
        PyErr_Format(PyExc_TypeError, "dumps gave %.100s, not bytes", Py_TYPE(data)->tp_name);
    Py_DECREF(data);
    return text;
}

/* The stored record's field ``name`` when it is a str (and non-empty with ``non_empty``),
 * else None: a new reference. */
static PyObject *
text_column(PyObject *stored, PyObject *name, int non_empty)
{
    PyObject *value = PyDict_GetItemWithError(stored, name);
    if (value != NULL && PyUnicode_CheckExact(value) && (!non_empty || PyUnicode_GET_LENGTH(value) > 0))
        return Py_NewRef(value);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* The status column: the stored status when a str, else its repr (None's when missing). */
static PyObject *
status_column(Rows *self, PyObject *stored)
{
    PyObject *status = PyDict_GetItemWithError(stored, self->names[STATUS]);
    if (status == NULL && PyErr_Occurred())
        return NULL;
    if (status != NULL && PyUnicode_CheckExact(status))
        return Py_NewRef(status);
    return PyObject_Repr(status ? status : Py_None);
}

/* The seq column: a plain int is within int64, the column's range, so it is kept as is. */
static PyObject *
seq_column(Rows *self, PyObject *stored)
{
    PyObject *seq = PyDict_GetItemWithError(stored, self->names[SEQ]);
    if (seq != NULL && PyLong_CheckExact(seq))
        return Py_NewRef(seq);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* An ActionRow holding ``parts`` (stolen, each non-NULL): made by the type's tp_new and
 * filled through its slots' descriptors, which costs a fraction of the dataclass's
 * generated __init__ (a Python call with nine arguments). */
static PyObject *
new_row(Rows *self, PyObject **parts)
{
    PyTypeObject *type = (PyTypeObject *)self->row_type;
    PyObject *row = type->tp_new(type, self->no_args, NULL);
    for (Py_ssize_t i = 0; i < ROW_SIZE; i++) {
        if (row != NULL && Py_TYPE(self->slots[i])->tp_descr_set(self->slots[i], row, parts[i]) < 0)
            Py_CLEAR(row);
        Py_DECREF(parts[i]);
    }
    return row;
}

/* The columns and text of ``stored`` into ``parts`` (new references, or NULL); 1 when
 * orjson refused the record, -1 with an error set, else 0. */
static int
fill_parts(Rows *self, PyObject *stored, PyObject **parts)
{
    parts[TEXT] = encoded(self, stored);
    if (parts[TEXT] == Py_None)
        return 1;
    parts[SESSION_ID] = text_column(stored, self->names[SESSION_ID], 1);
    parts[STATUS] = status_column(self, stored);
    parts[ACTION_ID] = text_column(stored, self->names[ACTION_ID], 0);
    parts[KIND] = text_column(stored, self->names[KIND], 0);
    parts[SEQ] = seq_column(self, stored);
    for (Py_ssize_t i = 0; i < ROW_SIZE; i++)
        if (parts[i] == NULL)
            return -1;
    return 0;
}

static PyObject *
Rows_row(Rows *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "row() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *record = args[0];
    if (!PyDict_CheckExact(record))
        return Py_NewRef(Py_None);
    PyObject *stored = stored_record(self, record);
    if (stored == NULL || stored == Py_None)
        return stored;
    PyObject *parts[ROW_SIZE] = {NULL};
    parts[TRACE_ID] = Py_NewRef(args[1]);
    parts[SPAN_ID] = Py_NewRef(args[2]);
    parts[RECORD] = Py_NewRef(record); /* checked_record: nothing differs */
    int status = fill_parts(self, stored, parts);
    Py_DECREF(stored);
    if (status == 0)
        return new_row(self, parts);
    for (Py_ssize_t i = 0; i < ROW_SIZE; i++)
        Py_XDECREF(parts[i]);
    return status < 0 ? NULL : Py_NewRef(Py_None);
}

/* --- construction ------------------------------------------------------------------ */

/* Map each str of ``names`` (an iterable) to ``kind`` in ``fields``. */
static int
add_fields(PyObject *fields, PyObject *names, PyObject *kind)
{
    PyObject *iterator = PyObject_GetIter(names);
    if (iterator == NULL)
        return -1;
    PyObject *name;
    while ((name = PyIter_Next(iterator)) != NULL) {
        int failed = !PyUnicode_CheckExact(name) || PyDict_SetItem(fields, name, kind) < 0;
        if (failed && !PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "field names must be str, not %.100s", Py_TYPE(name)->tp_name);
        Py_DECREF(name);
        if (failed)
            break;
    }
    Py_DECREF(iterator);
    return PyErr_Occurred() ? -1 : 0;
}

/* ``fields`` with each name of ``choices`` (a dict) mapped to a frozenset of its values. */
static int
add_choices(PyObject *fields, PyObject *choices)
{
    if (!PyDict_Check(choices)) {
        PyErr_SetString(PyExc_TypeError, "choices must be a dict of field name to values");
        return -1;
    }
    Py_ssize_t position = 0;
    PyObject *name, *values;
    while (PyDict_Next(choices, &position, &name, &values)) {
        if (!PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "field names must be str, not %.100s", Py_TYPE(name)->tp_name);
            return -1;
        }
        PyObject *set = PyFrozenSet_New(values);
        int failed = set == NULL || PyDict_SetItem(fields, name, set) < 0;
        Py_XDECREF(set);
        if (failed)
            return -1;
    }
    return 0;
}

static PyObject *
fields_of(PyObject *identifiers, PyObject *digests, PyObject *choices, PyObject *no_text)
{
    PyObject *fields = PyDict_New();
    PyObject *kinds[] = {PyLong_FromLong(IDENTIFIER), PyLong_FromLong(DIGEST), PyLong_FromLong(NO_TEXT)};
    int failed = fields == NULL || kinds[0] == NULL || kinds[1] == NULL || kinds[2] == NULL
        || add_fields(fields, identifiers, kinds[IDENTIFIER]) < 0 || add_fields(fields, digests, kinds[DIGEST]) < 0
        || add_fields(fields, no_text, kinds[NO_TEXT]) < 0 || add_choices(fields, choices) < 0;
    for (int i = 0; i < 3; i++)
        Py_XDECREF(kinds[i]);
    if (failed)
        Py_CLEAR(fields);
    return fields;
}

/* Whether the slots of ``row_type`` are ROW_FIELDS, in their order: a row made here sets
 * each of them, and a field added to ActionRow alone would be left unset. */
static int
has_row_fields(PyObject *row_type)
{
    PyObject *slots = PyObject_GetAttrString(row_type, "__slots__");
    PyObject *expected = PyTuple_New(ROW_SIZE);
    int same = slots != NULL && expected != NULL;
    for (Py_ssize_t i = 0; same && i < ROW_SIZE; i++) {
        PyObject *name = PyUnicode_FromString(ROW_FIELDS[i]);
        same = name != NULL;
        if (same)
            PyTuple_SET_ITEM(expected, i, name);
    }
    if (same)
        same = PyObject_RichCompareBool(slots, expected, Py_EQ);
    Py_XDECREF(slots);
    Py_XDECREF(expected);
    if (same == 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "%.100s's slots are not those _rows fills", ((PyTypeObject *)row_type)->tp_name);
    return same == 1 ? 0 : -1;
}

/* The row type's slot descriptors and their names into ``self``. */
static int
take_row_type(Rows *self, PyObject *row_type)
{
    if (!PyType_Check(row_type)) {
        PyErr_SetString(PyExc_TypeError, "row_type must be a class");
        return -1;
    }
    if (has_row_fields(row_type) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < ROW_SIZE; i++) {
        PyObject *name = PyUnicode_InternFromString(ROW_FIELDS[i]);
        PyObject *slot = name ? PyObject_GetAttr(row_type, name) : NULL;
        if (slot != NULL && Py_TYPE(slot)->tp_descr_set == NULL)
            PyErr_Format(PyExc_TypeError, "%.100s.%s is no slot", ((PyTypeObject *)row_type)->tp_name, ROW_FIELDS[i]);
        Py_XSETREF(self->names[i], name);
        Py_XSETREF(self->slots[i], slot);
        if (PyErr_Occurred())
            return -1;
    }
    Py_XSETREF(self->row_type, Py_NewRef(row_type));
    return 0;
}

static int
Rows_init(Rows *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "identifiers", "digests", "choices", "no_text", "max_text", "row_type", "dumps", "smallest_float", NULL,
    };
    PyObject *identifiers, *digests, *choices, *no_text, *row_type, *dumps;
    Py_ssize_t max_text;
    double smallest_float;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOnOOd:Rows", keywords, &identifiers, &digests, &choices,
                                     &no_text, &max_text, &row_type, &dumps, &smallest_float))
        return -1;
    PyObject *fields = fields_of(identifiers, digests, choices, no_text);
    if (fields == NULL || take_row_type(self, row_type) < 0) {
        Py_XDECREF(fields);
        return -1;
    }
    if (self->no_args == NULL && (self->no_args = PyTuple_New(0)) == NULL) {
        Py_DECREF(fields);
        return -1;
    }
    Py_XSETREF(self->fields, fields);
    Py_XSETREF(self->dumps, Py_NewRef(dumps));
    self->max_text = max_text;
    self->smallest_float = smallest_float;
    return 0;
}

static void
Rows_dealloc(Rows *self)
{
    Py_XDECREF(self->fields);
    Py_XDECREF(self->row_type);
    for (Py_ssize_t i = 0; i < ROW_SIZE; i++) {
        Py_XDECREF(self->slots[i]);
        Py_XDECREF(self->names[i]);
    }
    Py_XDECREF(self->dumps);
    Py_XDECREF(self->no_args);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(row_doc,
"row(record, trace_id, span_id)\n--\n\n"
"The ActionRow of ``record`` as base.action_row builds it, or None where ``record`` is\n"
"not plain (base.action_row then builds it).");

static PyMethodDef Rows_methods[] = {
    {"row", (PyCFunction)(void (*)(void))Rows_row, METH_FASTCALL, row_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Rows_doc,
"Rows(identifiers, digests, choices, no_text, max_text, row_type, dumps, smallest_float)\n--\n\n"
"Builds rows of ``row_type`` for records whose stored fields (the names in ``identifiers``,\n"
"``digests``, ``choices`` (name to its values) and ``no_text``) hold values stored as given;\n"
"``dumps`` writes the JSON text (orjson.dumps), as json would but for a nonzero float of\n"
"magnitude below ``smallest_float``, which it declines.");

static PyTypeObject RowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durable_sessions_collector.store._rows.Rows",
    .tp_basicsize = sizeof(Rows),
    .tp_dealloc = (destructor)Rows_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Rows_doc,
    .tp_methods = Rows_methods,
    .tp_init = (initproc)Rows_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions_collector.store._rows",
    .m_doc = "The ActionRow of a plain mapped record (base.action_row is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__rows(void)
{
    if (PyType_Ready(&RowsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&rows_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Rows", (PyObject *)&RowsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
