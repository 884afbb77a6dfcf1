/*
 * durable_sessions._engine: the engine's per-record dispatch (Checker.feed) in C.
 *
 * Checker.feed (durable_sessions/engine.py) is the reference. Around the rules it does
 * the same few steps for every record: read the four identifying fields, find the
 * session, recall the action id, look the record's shape up in the dispatch cache, call
 * the rules that apply, fold the record into the session. In CPython that bytecode cost
 * about as much as all the rules together in a big offline check. Feed.feed does those
 * steps in C and calls the same Python objects for everything else:
 *
 * - the whole of Checker.feed, when the record is not a plain dict or one of its four
 *   identifying fields is not a non-empty string (nothing has been done at that point);
 * - Checker._session, for a session not held;
 * - SessionState.recall and ActionMemory.is_redelivery, for an action id seen before;
 * - Checker._rules_for_shape, for a shape not in the dispatch cache;
 * - the rules' checks, Rule.on and the engine's fold (remember), always.
 *
 * Feed.feed_lines (Checker.feed_lines) feeds a parallel check's worker a block of its
 * lines: an owned line that orjson reads as an object goes to Feed.feed with no Python
 * frame in between; every other line (and one that may hold an integer beyond 64 bits,
 * which orjson rounds) goes to the worker's Python line checker.
 *
 * tests/test_engine_native.py checks that both feeds report the same violations and
 * leave the same memory, over the example logs and generated records and lines.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *S_SESSION_ID, *S_ACTION_ID, *S_KIND, *S_STATUS;
static PyObject *A_ACTIONS, *A_MAX_SESSIONS, *A_FAILURE_RUNS;
static PyObject *M_SESSION, *M_MOVE_TO_END, *M_RECALL, *M_IS_REDELIVERY, *M_RULES_FOR_SHAPE, *M_ON;

/* The Python objects a Feed holds, in one list so that each is taken, visited and
 * cleared alike. */
#define FEED_OBJECTS(X) \
    X(checker)          \
    X(python_feed)      \
    X(sessions)         \
    X(by_shape)         \
    X(remember)         \
    X(nowhere)          \
    X(loads)            \
    X(decode_error)     \
    X(location_type)

typedef struct {
    PyObject_HEAD
#define DECLARE(name) PyObject *name;
    FEED_OBJECTS(DECLARE)
#undef DECLARE
    int check_redeliveries; /* whether a recalled action's span delivered again is skipped */
} Feed;

/* checker.actions += delta (the checker's count and a session's map share the name) */
static int
count_actions(Feed *self, int delta)
{
    PyObject *count = PyObject_GetAttr(self->checker, A_ACTIONS);
    if (count == NULL)
        return -1;
    PyObject *delta_object = PyLong_FromLong(delta);
    PyObject *updated = delta_object ? PyNumber_Add(count, delta_object) : NULL;
    Py_DECREF(count);
    Py_XDECREF(delta_object);
    if (updated == NULL)
        return -1;
    int failed = PyObject_SetAttr(self->checker, A_ACTIONS, updated);
    Py_DECREF(updated);
    return failed;
}

static int
is_identifier(PyObject *value)
{
    return value != NULL && PyUnicode_CheckExact(value) && PyUnicode_GET_LENGTH(value) > 0;
}

/* The session the record belongs to, as Checker._session finds it (a new reference):
 * a held session, made the most recently active one when sessions are bounded. */
static PyObject *
session_of(Feed *self, PyObject *session_id, PyObject *violations)
{
    PyObject *session = PyDict_GetItemWithError(self->sessions, session_id);
    if (session == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_CallMethodObjArgs(self->checker, M_SESSION, session_id, violations, NULL);
    }
    Py_INCREF(session);
    PyObject *max_sessions = PyObject_GetAttr(self->checker, A_MAX_SESSIONS);
    PyObject *moved = max_sessions == Py_None || max_sessions == NULL
                        ? Py_XNewRef(max_sessions)
                        : PyObject_CallMethodOneArg(self->sessions, M_MOVE_TO_END, session_id);
    Py_XDECREF(max_sessions);
    if (moved == NULL)
        Py_CLEAR(session);
    Py_XDECREF(moved);
    return session;
}

/* session.recall(action_id): None at once for an id the session has not seen. */
static PyObject *
recall(PyObject *session, PyObject *action_id)
{
    PyObject *actions = PyObject_GetAttr(session, A_ACTIONS);
    if (actions == NULL)
        return NULL;
    PyObject *packed = PyDict_CheckExact(actions) ? PyDict_GetItemWithError(actions, action_id) : Py_None;
    Py_DECREF(actions);
    if (packed == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodObjArgs(session, M_RECALL, action_id, NULL);
}

/* (kind, status, tuple(record), prior is not None, bool(session.failure_runs)) */
static PyObject *
shape_of(PyObject *record, PyObject *kind, PyObject *status, PyObject *session, PyObject *prior)
{
    PyObject *fields = PyTuple_New(PyDict_GET_SIZE(record));
    if (fields == NULL)
        return NULL;
    Py_ssize_t pos = 0, index = 0;
    PyObject *key, *value;
    while (PyDict_Next(record, &pos, &key, &value))
        PyTuple_SET_ITEM(fields, index++, Py_NewRef(key));
    PyObject *failure_runs = PyObject_GetAttr(session, A_FAILURE_RUNS);
    int watching = failure_runs ? PyObject_IsTrue(failure_runs) : -1;
    Py_XDECREF(failure_runs);
    if (watching < 0) {
        Py_DECREF(fields);
        return NULL;
    }
    PyObject *shape = PyTuple_Pack(5, kind, status, fields, prior != Py_None ? Py_True : Py_False,
                                   watching ? Py_True : Py_False);
    Py_DECREF(fields);
    return shape;
}

/* The (record rules, session rules) pairs for the shape: the cache, else the checker. */
static PyObject *
rules_for(Feed *self, PyObject *shape, PyObject *record)
{
    PyObject *rules = PyDict_GetItemWithError(self->by_shape, shape);
    if (rules != NULL)
        return Py_NewRef(rules);
    if (PyErr_Occurred())
        return NULL;
    return PyObject_CallMethodObjArgs(self->checker, M_RULES_FOR_SHAPE, shape, record, NULL);
}

/* Run each (rule, check) pair on args; append rule.on(record, where, finding) for each finding. */
static int
run_checks(PyObject *pairs, PyObject *const *args, Py_ssize_t nargs, PyObject *record, PyObject *where,
           PyObject *violations)
{
    if (!PyTuple_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "the dispatch cache must hold tuples of (rule, check) pairs");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "the dispatch cache must hold tuples of (rule, check) pairs");
            return -1;
        }
        PyObject *finding = PyObject_Vectorcall(PyTuple_GET_ITEM(pair, 1), args, nargs, NULL);
        if (finding == NULL)
            return -1;
        int found = PyObject_IsTrue(finding);
        if (found > 0) {
            PyObject *violation = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(pair, 0), M_ON, record, where,
                                                             finding, NULL);
            found = violation == NULL ? -1 : PyList_Append(violations, violation);
            Py_XDECREF(violation);
        }
        Py_DECREF(finding);
        if (found < 0)
            return -1;
    }
    return 0;
}

/* Checker.feed's steps after the record is known to be usual; -1 on error. */
static int
check(Feed *self, PyObject *record, PyObject *where, PyObject *ids[4], PyObject *violations)
{
    PyObject *session = session_of(self, ids[0], violations);
    if (session == NULL)
        return -1;
    PyObject *prior = recall(session, ids[1]);
    PyObject *shape = NULL, *rules = NULL;
    int failed = prior == NULL;
    if (!failed && prior != Py_None && self->check_redeliveries) {
        PyObject *again = PyObject_CallMethodObjArgs(prior, M_IS_REDELIVERY, record, where, NULL);
        int redelivered = again ? PyObject_IsTrue(again) : -1;
        Py_XDECREF(again);
        if (redelivered != 0) {
            failed = redelivered < 0 || count_actions(self, -1) < 0;
            goto done;
        }
    }
    failed = failed || (shape = shape_of(record, ids[2], ids[3], session, prior)) == NULL
          || (rules = rules_for(self, shape, record)) == NULL;
    if (!failed && (!PyTuple_Check(rules) || PyTuple_GET_SIZE(rules) != 2)) {
        PyErr_SetString(PyExc_TypeError, "the dispatch cache must hold (record rules, session rules)");
        failed = 1;
    }
    if (!failed) {
        PyObject *session_args[4] = {session, record, where, prior};
        failed = run_checks(PyTuple_GET_ITEM(rules, 0), &record, 1, record, where, violations) < 0
              || run_checks(PyTuple_GET_ITEM(rules, 1), session_args, 4, record, where, violations) < 0;
        PyObject *folded = failed ? NULL : PyObject_Vectorcall(self->remember, session_args, 4, NULL);
        failed = folded == NULL;
        Py_XDECREF(folded);
    }
done:
    Py_XDECREF(rules);
    Py_XDECREF(shape);
    Py_XDECREF(prior);
    Py_DECREF(session);
    return failed ? -1 : 0;
}

/* Whether __init__ has run (Feed.__new__ alone leaves every object NULL). */
static int
ready(Feed *self)
{
    if (self->checker == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Feed is not initialised");
        return 0;
    }
    return 1;
}

static PyObject *
Feed_feed(Feed *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(self))
        return NULL;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "feed(record, where=NOWHERE) takes 1 or 2 arguments");
        return NULL;
    }
    PyObject *record = args[0], *where = nargs == 2 ? args[1] : self->nowhere;
    PyObject *ids[4] = {NULL, NULL, NULL, NULL};
    int usual = PyDict_CheckExact(record);
    PyObject *names[4] = {S_SESSION_ID, S_ACTION_ID, S_KIND, S_STATUS};
    /* Each identifier is held from the moment it is read: a rule, the fold, or even a
     * later lookup's key comparison could change the record. A lookup that fails is
     * left to the Python feed, which counts the record and raises as it would. */
    for (int i = 0; usual && i < 4; i++) {
        ids[i] = Py_XNewRef(PyDict_GetItemWithError(record, names[i]));
        if (ids[i] == NULL && PyErr_Occurred())
            PyErr_Clear();
        usual = is_identifier(ids[i]);
    }
    PyObject *violations = NULL;
    if (!usual)
        violations = PyObject_Vectorcall(self->python_feed, args, nargs, NULL);
    else if (count_actions(self, 1) == 0 && (violations = PyList_New(0)) != NULL
             && check(self, record, where, ids, violations) < 0)
        Py_CLEAR(violations);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(ids[i]);
    return violations;
}

/* Location(file, number): a line location, built as record.line_location builds it. */
static PyObject *
line_location(Feed *self, PyObject *file, PyObject *number)
{
    PyTypeObject *type = (PyTypeObject *)self->location_type;
    PyObject *where = type->tp_alloc(type, 4);
    if (where == NULL)
        return NULL;
    PyTuple_SET_ITEM(where, 0, Py_NewRef(file));
    PyTuple_SET_ITEM(where, 1, Py_NewRef(number));
    PyTuple_SET_ITEM(where, 2, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(where, 3, Py_NewRef(Py_None));
    return where;
}

/* json_text.may_hold_long_integer: whether a run of 19 digits or more follows what
 * starts a bare JSON number (':', ',', '[', a blank or '-'). orjson reads an integer
 * beyond 64 bits as a double; such a line goes to the Python line checker, which reads
 * it exactly. Every run of 19 digits covers one of the positions probed, 19 apart, so
 * a line is looked at byte by byte only around the digits found there. */
static int
is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static int
holds_long_integer(const char *line, Py_ssize_t len)
{
    Py_ssize_t probe = 18; /* covers the runs that start at probe - 18 or later */
    while (probe < len) {
        if (!is_digit(line[probe])) {
            probe += 19;
            continue;
        }
        Py_ssize_t start = probe, end = probe + 1;
        while (start > 0 && is_digit(line[start - 1]))
            start--;
        while (end < len && is_digit(line[end]))
            end++;
        if (end - start >= 19 && start > 0) {
            char before = line[start - 1];
            if (before == ':' || before == ',' || before == '[' || before == ' ' || before == '\t'
                || before == '\r' || before == '\n' || before == '-')
                return 1;
        }
        probe = end + 19; /* line[end] is no digit: the next run starts at end + 1 or later */
    }
    return 0;
}

/* The object on an owned line, or NULL with no error set when the line is not one (or
 * may hold an integer beyond 64 bits: the Python line checker reads those). */
static PyObject *
owned_object(Feed *self, PyObject *raw, PyObject *owned)
{
    if (owned != Py_True || !PyBytes_CheckExact(raw)
        || holds_long_integer(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw)))
        return NULL;
    PyObject *value = PyObject_Vectorcall(self->loads, &raw, 1, NULL);
    if (value == NULL) {
        if (PyErr_ExceptionMatches(self->decode_error))
            PyErr_Clear();
        return NULL;
    }
    if (PyDict_CheckExact(value))
        return value;
    Py_DECREF(value);
    return NULL;
}

/* One (number, raw, owned) line: fed when it holds an object, else given to other. */
static PyObject *
feed_line(Feed *self, PyObject *line, PyObject *file, PyObject *other)
{
    if (!PyTuple_Check(line) || PyTuple_GET_SIZE(line) != 3) {
        PyErr_SetString(PyExc_TypeError, "feed_lines: each line must be (number, raw, owned)");
        return NULL;
    }
    PyObject *number = PyTuple_GET_ITEM(line, 0);
    PyObject *record = owned_object(self, PyTuple_GET_ITEM(line, 1), PyTuple_GET_ITEM(line, 2));
    if (record == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(other, PySequence_Fast_ITEMS(line), 3, NULL);
    }
    PyObject *where = line_location(self, file, number);
    PyObject *violations = NULL;
    if (where != NULL) {
        PyObject *args[2] = {record, where};
        violations = Feed_feed(self, args, 2);
    }
    Py_XDECREF(where);
    Py_DECREF(record);
    return violations;
}

static int
extend(PyObject *list, PyObject *items)
{
    PyObject *sequence = PySequence_Fast(items, "feed_lines: other must return a list of violations");
    if (sequence == NULL)
        return -1;
    int failed = 0;
    for (Py_ssize_t i = 0; !failed && i < PySequence_Fast_GET_SIZE(sequence); i++)
        failed = PyList_Append(list, PySequence_Fast_GET_ITEM(sequence, i));
    Py_DECREF(sequence);
    return failed;
}

static PyObject *
Feed_feed_lines(Feed *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(self))
        return NULL;
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "feed_lines(lines: list, file, other) takes 3 arguments");
        return NULL;
    }
    PyObject *lines = args[0], *found = PyList_New(0);
    for (Py_ssize_t i = 0; found != NULL && i < PyList_GET_SIZE(lines); i++) {
        PyObject *line = Py_NewRef(PyList_GET_ITEM(lines, i));
        PyObject *violations = feed_line(self, line, args[1], args[2]);
        Py_DECREF(line);
        int failed = violations == NULL || extend(found, violations) < 0;
        Py_XDECREF(violations);
        if (failed)
            Py_CLEAR(found);
    }
    return found;
}

static int
Feed_init(Feed *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"checker", "python_feed", "sessions", "by_shape", "remember", "nowhere",
                            "loads", "decode_error", "location_type", "check_redeliveries", NULL};
    Feed given = {0};
    given.check_redeliveries = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O$OO!O!OOOOO!p:Feed", names, &given.checker, &given.python_feed,
                                     &PyDict_Type, &given.sessions, &PyDict_Type, &given.by_shape, &given.remember,
                                     &given.nowhere, &given.loads, &given.decode_error, &PyType_Type,
                                     &given.location_type, &given.check_redeliveries))
        return -1;
    if (!PyType_IsSubtype((PyTypeObject *)given.location_type, &PyTuple_Type)
        || !PyExceptionClass_Check(given.decode_error)) {
        PyErr_SetString(PyExc_TypeError, "location_type must be a tuple type and decode_error an exception class");
        return -1;
    }
    if (!PyDict_CheckExact(given.by_shape)) {
        PyErr_SetString(PyExc_TypeError, "by_shape must be a dict");
        return -1;
    }
#define TAKE(name) Py_XSETREF(self->name, Py_NewRef(given.name));
    FEED_OBJECTS(TAKE)
#undef TAKE
    self->check_redeliveries = given.check_redeliveries;
    return 0;
}

static int
Feed_traverse(Feed *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    FEED_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
Feed_clear(Feed *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    FEED_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
Feed_dealloc(Feed *self)
{
    PyObject_GC_UnTrack(self);
    Feed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Feed_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))Feed_feed, METH_FASTCALL,
     "feed(record, where=NOWHERE) -> list of violations: Checker.feed(record, where), in C."},
    {"feed_lines", (PyCFunction)(void (*)(void))Feed_feed_lines, METH_FASTCALL,
     "feed_lines(lines, file, other) -> list of violations: Checker.feed_lines(lines, file, other), in C."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FeedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durable_sessions._engine.Feed",
    .tp_basicsize = sizeof(Feed),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Feeds records to a Checker's rules and session memory, as Checker.feed does.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Feed_init,
    .tp_traverse = (traverseproc)Feed_traverse,
    .tp_clear = (inquiry)Feed_clear,
    .tp_dealloc = (destructor)Feed_dealloc,
    .tp_methods = Feed_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "durable_sessions._engine",
    .m_doc = "Optional native dispatch of records to the engine's rules (see durable_sessions.native).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__engine(void)
{
    if (PyType_Ready(&FeedType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(S_SESSION_ID, "session_id");
    INTERN(S_ACTION_ID, "action_id");
    INTERN(S_KIND, "kind");
    INTERN(S_STATUS, "status");
    INTERN(A_ACTIONS, "actions");
    INTERN(A_MAX_SESSIONS, "max_sessions");
    INTERN(A_FAILURE_RUNS, "failure_runs");
    INTERN(M_SESSION, "_session");
    INTERN(M_MOVE_TO_END, "move_to_end");
    INTERN(M_RECALL, "recall");
    INTERN(M_IS_REDELIVERY, "is_redelivery");
    INTERN(M_RULES_FOR_SHAPE, "_rules_for_shape");
    INTERN(M_ON, "on");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FeedType);
    if (PyModule_AddObject(m, "Feed", (PyObject *)&FeedType) < 0) {
        Py_DECREF(&FeedType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
