;;;; settings.lisp -- every setting a user gives a Gallop server, its default
;;;; and its meaning, in one table.
;;;;
;;;; The same names are MAKE-ENGINE's keywords, GALLOP:START's (and so
;;;; Clack's, which passes on START's keywords) and GALLOP:TASKMASTER's
;;;; initargs: each layer takes them from +SETTINGS+ through the macros below
;;;; instead of listing them again, so a setting added here reaches every
;;;; front end with one default.

(in-package #:gallop.core)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (sb-int:defconstant-eqx +settings+
    '((max-thread-count 100
       "The most worker threads the pool grows to.")
      (standby-thread-count 4
       "Workers kept when idle; the pool shrinks back to this (at least 1, at
most MAX-THREAD-COUNT).")
      (thread-idle-timeout 10
       "Seconds an idle worker beyond the standby count waits before it leaves.")
      (header-timeout 20
       "Seconds for a whole request head; 408 after.")
      (idle-timeout 20
       "Seconds a keep-alive connection may stay idle between requests.")
      (read-timeout 20
       "Seconds a read of a request body may go without progress.")
      (write-timeout 20
       "Seconds a write may go without progress (a client that reads nothing of
its answer for this long is closed).")
      (handler-timeout nil
       "Seconds a request's handler may run, or NIL for no limit.  Past it
GALLOP:HANDLER-TIMEOUT is signalled in the handler's thread: the client gets
503 and the connection is closed.")
      (max-head-bytes +default-max-head-bytes+
       "Request heads over this many octets get 431.")
      (max-request-line-bytes +default-max-request-line-bytes+
       "Request lines over this many octets get 414.")
      (max-body-bytes +default-max-body-bytes+
       "Request bodies over this many octets get 413 (a declared
Content-Length before the body is read; a chunked body when it grows past it).")
      (max-unsent-bytes +default-max-unsent-bytes+
       "Octets a streaming writer may leave unsent on a connection whose client
does not read yet before what it writes on is charged to the memory account:
the writer goes on while the account takes it, and waits for the client only
when the account refuses (MAX-WAITING-WRITERS).  What the client has not read
when the handler returns waits with the connection in epoll, not in a worker.")
      (max-waiting-writers nil
       "Writers of one server that may wait for their clients at once, because
the memory account refused what they write (NIL: the number of CPUs the
process may use).  Past it, such a writer's connection is closed instead
\(:WRITERS-SHED), so that slow readers never hold more workers than this.")
      (upgraded-idle-timeout 60
       "Seconds a connection that switched protocols (a WebSocket) may receive
nothing before it is closed, with no close frame; NIL: no limit.  A front
end may set its own per connection.  Without a limit, clients that connect
and stay silent hold their fds for good, and keep every new client out
once the fds are spent.  60 s is nginx's proxy_read_timeout for the
WebSockets it proxies; a client that may stay silent longer is kept open by
the server's pings, whose pongs count (GALLOP:ACCEPT-WEBSOCKET's
:PING-INTERVAL).  It is also how long a read may wait on a connection
switched under a handler that keeps its thread (hunchensocket) when that
handler set no timeout of its own (Hunchentoot's SET-TIMEOUTS); NIL there:
READ-TIMEOUT, since such a connection holds a thread.")
      (upgraded-send-limit (* 1024 1024)
       "Octets that may wait, sent on a connection that switched protocols, for a
client that does not read them: a send past it closes the connection (a
native WebSocket with 1008, doc/websockets.md).  One message alone may be
larger.  While memory is short (overload level 1 or more), 64 KiB.")
      (max-switched-threads nil
       "The most connections that may switch protocols under a handler that
keeps its thread (hunchensocket's WebSockets), each holding a thread outside
the pool until it ends; NIL: as many as memory allows.  Either way each
charges its thread's stacks to the memory account (kind :STACKS): its
control stack (SBCL's --control-stack-size, 2 MiB by default) and its
binding, alien and signal stacks, about 4.5 MiB in all.  A 101 past this
cap, or that the account cannot take, is answered 503 with Retry-After
instead, as is every new one from overload level 2 on.  Stacks are mapped
outside the heap and have a limit of their own in the account, the heap's
size unless set (GALLOP:SET-MEMORY-LIMIT's :STACKS): with SBCL's default
heap of 1 GiB, about 226 at once.")
      (head-budget nil
       "Octets of input buffers that connections with a partial request head may
hold in all (NIL: a quarter of the heap); past it a new one gets 503.")
      (body-buffer-bytes (* 64 1024)
       "Octets of one request's body the engine keeps in memory while it reads
the body, before the handler runs; a longer body goes to a temporary file
\(nginx's client_body_buffer_size).")
      (body-budget nil
       "Octets of request bodies kept in memory in all (NIL: an eighth of the
heap); past it, bodies go to temporary files.")
      (body-temp-directory nil
       "Where bodies past BODY-BUFFER-BYTES go, unlinked at once (NIL: $TMPDIR,
else /tmp; nginx's client_body_temp_path).")
      (body-disk-budget (* 2 1024 1024 1024)
       "Octets of request bodies in temporary files in all; a body that would
go past it gets 503 with Retry-After.")
      (streamed-bodies nil
       "NIL, or a function of a request's method (a keyword) and path (a
string: the target as sent, without its query, not percent-decoded), true
when its handler reads the body as it arrives (a proxy, an
upload it processes on the fly) instead of once the engine has read it all.
Such a body holds a worker while it arrives, bounded by MIN-DATA-RATE.")
      (min-data-rate 240
       "Octets a second a client must average, after MIN-DATA-RATE-GRACE, while
it sends a request head or body or reads an answer the server is waiting to
send (Kestrel's MinRequestBodyDataRate and MinResponseDataRate); slower, it
gets 408 or is closed.  NIL: no minimum.")
      (min-data-rate-grace 5
       "Seconds before MIN-DATA-RATE applies.")
      (stop-timeout 20
       "Seconds a soft stop may take: for requests in flight, for those clients
had already sent, and for idle keep-alive connections' next requests.  Past
it the rest are cut as a hard stop cuts them: a handler still running is
interrupted, its client gets 503 if no answer began, and the request is
logged and counted (:STOP-CUT).")
      (stop-idle-grace 1
       "Seconds a soft stop keeps idle keep-alive connections open (within
STOP-TIMEOUT), so that a request a client sends on one meanwhile is
answered, with Connection: close, rather than met by a close.  Clients that
send nothing are closed after it.")
      (max-queue-length 1024
       "The most accepted connections waiting for a worker (their whole request
head sent, no worker free) before new ones get an immediate 503 with
Retry-After.  Connections that sent nothing or part of a head do not
count."))
    #'equal
    "Each user setting: (NAME DEFAULT-FORM DOCUMENTATION).  Times in seconds,
sizes in octets."))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun setting-symbol (setting)
    "The symbol named as SETTING in the package of the code being compiled: the
name its parameter, variable or slot has there."
    (intern (symbol-name setting) *package*)))

(defmacro define-settings-function (name (&rest required) (&rest keys) documentation
                                    &body body)
  "DEFUN NAME with the REQUIRED parameters and the &KEY parameters KEYS,
followed by one &KEY parameter per setting, with its default (+SETTINGS+)."
  `(defun ,name (,@required &key ,@keys
                 ,@(loop for (setting default) in +settings+
                         collect (list (setting-symbol setting) default)))
     ,documentation
     ,@body))

(defmacro setting-default (name)
  "The default of the setting NAME (a form, evaluated where this is used)."
  (let ((entry (assoc (symbol-name name) +settings+ :key #'symbol-name :test #'string=)))
    (unless entry (error "~S is not a setting (see +SETTINGS+)." name))
    (second entry)))

(defmacro setting-arguments (&optional (value-of 'identity))
  "A keyword argument list of every setting, each the variable of its name
\(or (VALUE-OF NAME), VALUE-OF a macro or function name): what a function
defined with DEFINE-SETTINGS-FUNCTION passes on."
  `(list ,@(loop for (setting) in +settings+
                 collect (intern (symbol-name setting) :keyword)
                 collect (let ((variable (setting-symbol setting)))
                           (if (eq value-of 'identity) variable `(,value-of ,variable))))))

(eval-when (:compile-toplevel :load-toplevel :execute)
(defun setting-slot-definitions (&key readers initforms)
  "Slot specifications of a class with one slot per setting: initarg of its
name, initform its default (or the one in the plist INITFORMS), its
documentation, and the reader READERS (a plist) names for it."
  (loop for (setting default documentation) in +settings+
        for key = (intern (symbol-name setting) :keyword)
        collect `(,(setting-symbol setting) :initarg ,key
                           :initform ,(getf initforms key default)
                           ,@(let ((reader (getf readers key)))
                               (and reader `(:reader ,reader)))
                           :documentation ,documentation))))
