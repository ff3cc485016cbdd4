/*
 * sluice._wirescan: whether a piece of message content may go on the wire as
 * it is, in one pass at memory speed.
 *
 * STRATEGY
 *     The twin of _wirescan.py (its docstring says what "clean" means and
 *     what clean_run answers).  The bytes methods and regular expressions
 *     that file uses each walk the chunk a byte at a time, about 45 us a
 *     pass over 100 KB; the encoder needed five such passes per chunk.  Here
 *     two memchr walks do it: one finds each LF (a line is some 80 bytes, memchr runs at tens of
 *     GB/s), the bytes around it are checked, and the CRs are counted the
 *     same way: every LF must have its CR, and as many CRs as LFs leaves no
 *     CR without its LF.  About 24 us for 100 KB.
 *
 *     The receiver's two searches (dot_line, end_mark) walk the LFs the same
 *     way.
 *
 *     Built by setup.py beside the mypyc modules and kept out, like them,
 *     when its source has changed since the build (sluice._native).  A
 *     property test holds it to the Python twin (tests/unit/test_wirescan.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static Py_ssize_t
scan(const unsigned char *p, Py_ssize_t n, int at_line_start, Py_ssize_t col,
     Py_ssize_t limit)
{
    const unsigned char *end = p + n, *q;
    Py_ssize_t lfs = 0, crs = 0, line_start = 0, carried = col;

    if (n == 0)
        return col;
    if (p[n - 1] == '\r' || (at_line_start && p[0] == '.'))
        return -1;
    for (q = p; (q = memchr(q, '\n', (size_t)(end - q))) != NULL; q++) {
        Py_ssize_t i = q - p;
        if (i == 0 || p[i - 1] != '\r')
            return -1;                      /* an LF without its CR */
        if (i + 1 < n && p[i + 1] == '.')
            return -1;                      /* a line that starts with "." */
        if (limit > 0 && carried + (i - 1 - line_start) > limit)
            return -1;                      /* a line over the limit */
        carried = 0;
        line_start = i + 1;
        lfs++;
    }
    for (q = p; (q = memchr(q, '\r', (size_t)(end - q))) != NULL; q++)
        crs++;
    if (crs != lfs)
        return -1;                          /* a CR without its LF */
    carried += n - line_start;
    if (limit > 0 && carried > limit)
        return -1;
    return carried;
}

static PyObject *
clean_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t col, limit, result;
    int at_line_start;

    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "clean_run(data, at_line_start, col, limit) takes 4 arguments");
        return NULL;
    }
    at_line_start = PyObject_IsTrue(args[1]);
    if (at_line_start < 0)
        return NULL;
    col = PyLong_AsSsize_t(args[2]);
    if (col == -1 && PyErr_Occurred())
        return NULL;
    limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (col < 0 || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "clean_run: col and limit must be >= 0");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (col > PY_SSIZE_T_MAX - view.len) {   /* col + len must not overflow */
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_OverflowError, "clean_run: col too large");
        return NULL;
    }
    result = scan((const unsigned char *)view.buf, view.len, at_line_start, col, limit);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(result);
}

/* Whether an LF in data is followed by ".". */
static PyObject *
dot_line(PyObject *module, PyObject *data)
{
    Py_buffer view;
    const unsigned char *p, *end, *q;
    int found = 0;

    (void)module;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    p = (const unsigned char *)view.buf;
    end = p + view.len;
    for (q = p; (q = memchr(q, '\n', (size_t)(end - q))) != NULL; q++) {
        if (q + 1 < end && q[1] == '.') {
            found = 1;
            break;
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}

/* The index just past the first ".CRLF" at or after start in buf, or -1.
 * Found by its LF: a line is some 80 bytes, a "." far more frequent. */
static PyObject *
end_mark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    const unsigned char *p, *end, *q;
    Py_ssize_t start, result = -1;

    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "end_mark(buf, start) takes 2 arguments");
        return NULL;
    }
    start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    p = (const unsigned char *)view.buf;
    end = p + view.len;
    if (start < 0)
        start = 0;
    if (start > view.len)   /* so that start + 2 cannot overflow */
        start = view.len;
    if (start + 2 < view.len) {
        for (q = p + start + 2; (q = memchr(q, '\n', (size_t)(end - q))) != NULL; q++) {
            if (q[-1] == '\r' && q[-2] == '.') {
                result = q - p + 1;
                break;
            }
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"clean_run", (PyCFunction)(void (*)(void))clean_run, METH_FASTCALL,
     "clean_run(data, at_line_start, col, limit) -> int: the unfinished last line's "
     "length if data may go out as it is, else -1 (see _wirescan.py)."},
    {"dot_line", dot_line, METH_O,
     "dot_line(data) -> bool: whether an LF in data is followed by \".\"."},
    {"end_mark", (PyCFunction)(void (*)(void))end_mark, METH_FASTCALL,
     "end_mark(buf, start) -> int: the index just past the first \".CRLF\" at or after "
     "start, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "sluice._wirescan",
    "Whether a piece of message content may go on the wire as it is (C; see _wirescan.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__wirescan(void)
{
    return PyModule_Create(&module_def);
}
