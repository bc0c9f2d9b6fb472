;;;; util.lisp -- what the tests share: starting servers on 127.0.0.1, a raw
;;;; HTTP client over real sockets, and counting this process's threads and fds.
;;;;
;;;; It is also where the tests of the front ends (tests/native, hunchentoot,
;;;; clack, production, stress) reach into the core when no export says
;;;; what they need: the memory account (account.lisp), the fd limit, the
;;;; core's clocks and a connection's socket.  Each such helper names the
;;;; core internal it reads and why; the front ends themselves may name only
;;;; GALLOP.CORE's exports (tests/core/contract.lisp).

(in-package #:gallop-tests)

(def-suite gallop :description "All of Gallop's tests.")

(defparameter *quiet-log* nil
  "Where test servers log messages (NIL: nowhere).  Set GALLOP_TEST_LOG=1 to see them.")

(defun message-log-destination ()
  (if (uiop:getenv "GALLOP_TEST_LOG") *error-output* *quiet-log*))

(defun make-server (class &rest initargs)
  "Make an acceptor of CLASS on 127.0.0.1 and a free port, with logs off."
  (apply #'make-instance class
         (append initargs
                 (list :address "127.0.0.1" :port 0
                       :access-log-destination nil
                       :message-log-destination (message-log-destination)))))

(defmacro with-server ((var class &rest initargs) &body body)
  "Start an acceptor, run BODY, and always stop it."
  `(let ((,var (make-server ,class ,@initargs)))
     (hunchentoot:start ,var)
     (unwind-protect (progn ,@body)
       (when (hunchentoot:started-p ,var)
         (hunchentoot:stop ,var)))))

(defun port-of (acceptor) (hunchentoot:acceptor-port acceptor))

(defun url (acceptor path)
  (format nil "http://127.0.0.1:~D~A" (port-of acceptor) path))

;;; A raw HTTP/1.x client: the test writes exactly the bytes it wants and
;;; reads exactly what the server sends.

(defun connect (port &key (timeout 10))
  (let ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8)
                                                         :timeout timeout)))
    (setf (sb-impl::fd-stream-timeout (usocket:socket-stream socket)) (float timeout 1.0))
    socket))

(defun octets (string)
  (map '(vector (unsigned-byte 8)) #'char-code string))

(defun crlf (&rest lines)
  "Join LINES with CRLF and end with an empty line."
  (format nil "~{~A~C~C~}~C~C"
          (loop for l in lines append (list l #\Return #\Linefeed))
          #\Return #\Linefeed))

(defun send (socket string)
  (let ((stream (usocket:socket-stream socket)))
    (write-sequence (octets string) stream)
    (force-output stream)))

(defun setsockopt (fd level option pointer size)
  "setsockopt(2) on the socket FD with the SIZE octets at POINTER (an alien
pointer); signals on failure."
  (assert (zerop (sb-alien:alien-funcall
                  (sb-alien:extern-alien "setsockopt"
                                         (function sb-alien:int sb-alien:int sb-alien:int
                                                   sb-alien:int (* t) sb-alien:unsigned))
                  fd level option pointer size))
          () "setsockopt ~D ~D on fd ~D failed" level option fd))

(defun set-socket-option (fd level option value)
  "setsockopt(2) of an int VALUE on the socket FD."
  (sb-alien:with-alien ((int sb-alien:int value))
    (setsockopt fd level option (sb-alien:cast (sb-alien:addr int) (* t)) 4)))

(defun set-reset-on-close (fd)
  "Make closing the socket FD send a TCP RST instead of a FIN (SOL_SOCKET,
SO_LINGER on, 0 s)."
  (sb-alien:with-alien ((linger (array (sb-alien:signed 32) 2)))
    (setf (sb-alien:deref linger 0) 1
          (sb-alien:deref linger 1) 0)
    (setsockopt fd 1 13 (sb-alien:cast (sb-alien:addr linger) (* t)) 8)))

(defun read-line-crlf (stream)
  "Read a line ending in LF (CR dropped); NIL at end of file."
  (let ((chars '()))
    (loop for b = (read-byte stream nil nil)
          do (cond ((null b) (return (and chars (coerce (nreverse chars) 'string))))
                   ((= b 10) (return (coerce (nreverse chars) 'string)))
                   ((= b 13))
                   (t (push (code-char b) chars))))))

(defstruct response status headers body)

(defun header (response name)
  (cdr (assoc name (response-headers response) :test #'string-equal)))

(defun read-response (socket &key head-only)
  "Read one HTTP response from SOCKET.  Returns a RESPONSE, or NIL if the
server closed the connection before sending a status line."
  (let* ((stream (usocket:socket-stream socket))
         (status-line (read-line-crlf stream)))
    (when (and status-line (plusp (length status-line)))
      (let* ((status (parse-integer status-line :start 9 :end 12))
             (headers (loop for line = (read-line-crlf stream)
                            until (or (null line) (zerop (length line)))
                            collect (let ((colon (position #\: line)))
                                      (cons (subseq line 0 colon)
                                            (string-trim " " (subseq line (1+ colon)))))))
             (response (make-response :status status :headers headers)))
        ;; Interim (1xx) answers have no body.
        (unless (or head-only (< status 200))
          (setf (response-body response)
                (let ((length (cdr (assoc "Content-Length" headers :test #'string-equal)))
                      (chunked (search "chunked" (or (cdr (assoc "Transfer-Encoding" headers
                                                                 :test #'string-equal))
                                                     ""))))
                  (cond (length
                         (let ((body (make-array (parse-integer length)
                                                 :element-type '(unsigned-byte 8))))
                           (read-sequence body stream)
                           body))
                        (chunked (read-chunked-body stream))
                        (t (read-to-eof stream))))))
        response))))

(defun read-chunked-body (stream)
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for size = (parse-integer (read-line-crlf stream) :radix 16 :junk-allowed t)
          until (zerop size)
          do (let ((chunk (make-array size :element-type '(unsigned-byte 8))))
               (read-sequence chunk stream)
               (loop for b across chunk do (vector-push-extend b body))
               (read-line-crlf stream)))
    (loop for line = (read-line-crlf stream) until (or (null line) (zerop (length line))))
    body))

(defun read-to-eof (stream)
  (let ((body (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for b = (read-byte stream nil nil) while b do (vector-push-extend b body))
    body))

(defun body-string (response)
  (map 'string #'code-char (response-body response)))

(defun closed-by-peer-p (socket &key (timeout 5))
  "True if the server closes SOCKET (end of file) within TIMEOUT seconds, with
no further bytes."
  (let ((stream (usocket:socket-stream socket)))
    (setf (sb-impl::fd-stream-timeout stream) (float timeout 1.0))
    (handler-case (null (read-byte stream nil nil))
      (sb-sys:io-timeout () nil))))

(defun request (port string &key head-only)
  "Send STRING on a new connection, read one response, close."
  (let ((socket (connect port)))
    (unwind-protect (progn (send socket string) (read-response socket :head-only head-only))
      (usocket:socket-close socket))))

(defun get-request (port path &rest extra-headers)
  (request port (apply #'crlf (format nil "GET ~A HTTP/1.1" path) "Host: 127.0.0.1"
                       extra-headers)))

(defun count-matches (needle haystack)
  "How many times NEEDLE occurs in HAYSTACK."
  (loop with start = 0
        for position = (search needle haystack :start2 start)
        while position
        count t
        do (setf start (1+ position))))

;;; Native servers (GALLOP:START)

(defmacro with-memory-limit ((octets &key (stacks nil stacks-p)) &body body)
  "Run BODY with the account's limit OCTETS (NIL: the default), and with
STACKS the stacks' own; the limits as they were after."
  (let ((old (gensym "OLD")) (old-stacks (gensym "OLD-STACKS")))
    `(let ((,old (gallop.core::account-limit))
           (,old-stacks (gallop.core::account-limit :stacks)))
       (unwind-protect (progn (gallop.core:set-memory-limit ,octets
                                                            ,@(and stacks-p `(:stacks ,stacks)))
                              ,@body)
         (gallop.core:set-memory-limit ,old :stacks ,old-stacks)))))

(defmacro with-charged ((percent) &body body)
  "Run BODY with the heap's kinds of the account filled to PERCENT of their
limit by a charge of the test's own (as :INFLATE, which these tests' clients
do not use), given back after.  The charge is what is missing when BODY
begins: clients' octets counted then stay theirs."
  (let ((charged (gensym "CHARGED")))
    `(let ((,charged (max 0 (- (floor (* ,percent (gallop.core::account-limit)) 100)
                               (gallop.core::heap-used)))))
       (gallop.core::account-add :inflate ,charged)
       (unwind-protect (progn ,@body)
         (gallop.core::account-add :inflate (- ,charged))))))

(defmacro with-app ((server app &rest options) &body body)
  "Serve APP with GALLOP:START on 127.0.0.1 and a free port, run BODY, and
always stop it."
  `(let ((,server (gallop:start ,app ,@options
                                     :address "127.0.0.1" :port 0
                                     :log (if (uiop:getenv "GALLOP_TEST_LOG") *error-output* nil))))
     (unwind-protect (progn ,@body)
       (gallop:stop ,server))))

(defun native-port (server) (gallop:server-port server))

;;; Resources of this process

(defun threads-started-since (before)
  "The threads alive now that are not in BEFORE (a list of threads, as
SB-THREAD:LIST-ALL-THREADS gave it), SBCL's own ephemeral ones (the
finalizer) aside.  A leak check names the threads it finds, rather than
comparing counts, so that a thread of the test's that ends meanwhile cannot
hide one the server left behind."
  (remove-if (lambda (thread)
               (or (member thread before)
                   (sb-thread::thread-ephemeral-p thread)
                   (not (sb-thread:thread-alive-p thread))))
             (sb-thread:list-all-threads)))

(defun no-threads-left-p (before &key (timeout 10))
  "True once every thread started since BEFORE was taken has ended (waiting
at most TIMEOUT seconds for them to finish exiting)."
  (wait-until (lambda () (null (threads-started-since before))) :timeout timeout))

(defun fd-count ()
  "How many fds this process has open, the listing's own among them: the
entries of /proc/self/fd, read with readdir(3).  DIRECTORY would look each
entry up too, and signals when an fd closes while it lists them (a server
thread closing a connection meanwhile)."
  (let ((dir (sb-posix:opendir "/proc/self/fd")))
    (unwind-protect
         (loop for entry = (sb-posix:readdir dir)
               until (sb-alien:null-alien entry)
               count (not (member (sb-posix:dirent-name entry) '("." "..") :test #'string=)))
      (sb-posix:closedir dir))))

(defun raise-fd-limit (&optional (wanted most-positive-fixnum))
  "The core's RAISE-FD-LIMIT (os/syscalls.lisp): the soft RLIMIT_NOFILE raised
towards WANTED.  A test that opens thousands of sockets needs it; no front
end does, so the core does not export it."
  (gallop.core::raise-fd-limit wanted))

(defun memory-used (&optional kind)
  "Octets the process's memory account (the core's account.lisp) counts of
KIND, or of all kinds: what GALLOP:STATS gives as :MEMORY-BYTES and :MEMORY,
read without a server, as the tests of what the account is charged need."
  (gallop.core::account-used kind))

(defun overload-level-now ()
  "The overload manager's level now, 0 to 3 (the core's OVERLOAD-LEVEL,
account.lisp): GALLOP:STATS' :OVERLOAD-LEVEL, read without a server."
  (gallop.core::overload-level))

(defun core-now-ms ()
  "The core's own monotonic clock in milliseconds (NOW-MS, os/syscalls.lisp,
coarse: one kernel tick): a test that counts what the core does per second
must read the seconds the core reads."
  (gallop.core::now-ms))

(defun core-now-us ()
  "The core's precise monotonic clock in microseconds (NOW-US,
os/syscalls.lisp): GET-INTERNAL-REAL-TIME may be the coarse one, a few ms
behind."
  (gallop.core::now-us))

(defun thread-switches (thread)
  "The context switches THREAD made so far, voluntary or not, from the kernel."
  (with-open-file (in (format nil "/proc/self/task/~D/status" (sb-thread:thread-os-tid thread)))
    (loop for line = (read-line in nil)
          while line
          when (or (uiop:string-prefix-p "voluntary_ctxt_switches:" line)
                   (uiop:string-prefix-p "nonvoluntary_ctxt_switches:" line))
            sum (parse-integer line :start (1+ (position #\: line))))))

(defun switches-during (thread seconds)
  "The context switches THREAD makes while this thread sleeps SECONDS."
  (let ((before (thread-switches thread)))
    (sleep seconds)
    (- (thread-switches thread) before)))

(defun wait-until (predicate &key (timeout 10) (interval 0.05))
  "Poll PREDICATE until it is true or TIMEOUT seconds pass; return its value."
  (loop with deadline = (+ (get-internal-real-time) (* timeout internal-time-units-per-second))
        for value = (funcall predicate)
        when value return value
        when (> (get-internal-real-time) deadline) return nil
        do (sleep interval)))

(defvar *handler-waiting* nil
  "A semaphore a handler that calls WAIT-FOR-CLIENT-OCTETS signals when it
begins to wait, or NIL.")
(defvar *client-octets-sent* nil
  "A semaphore the test signals once its client sent the octets a handler
waits for (WAIT-FOR-CLIENT-OCTETS); NIL: handlers do not wait.")

(defun wait-for-client-octets (c)
  "In a handler, when a test asks for it (*CLIENT-OCTETS-SENT*): wait until
the client sent its next octets and they are in the socket of the core's
connection C, not yet read by the engine, whose event for them comes while
the handler runs.  The wait is on the socket itself (the core's POLL-FDS on
its fd): no exported function waits for octets the engine has not read."
  (let ((sent *client-octets-sent*))
    (when sent
      (sb-thread:signal-semaphore *handler-waiting*)
      (sb-thread:wait-on-semaphore sent :timeout 10)
      (gallop.core::poll-fds (gallop.core::connection-fd c) gallop.core::+pollin+ -1 5000))))

(defun send-while-handler-waits (socket string)
  "Send STRING on SOCKET once the handler waits for it (WAIT-FOR-CLIENT-OCTETS),
then let the handler go on."
  (sb-thread:wait-on-semaphore *handler-waiting* :timeout 10)
  (send socket string)
  (sb-thread:signal-semaphore *client-octets-sent*))

(defmacro with-globals ((&rest bindings) &body body)
  "Set global (not thread-local) values for BODY, then restore them: handlers
run in worker threads, which do not see a LET binding of the test's thread."
  (let ((saved (loop for b in bindings collect (gensym))))
    `(let ,(loop for (var) in bindings for s in saved collect `(,s ,var))
       (unwind-protect (progn (setf ,@(loop for (var value) in bindings append `(,var ,value)))
                              ,@body)
         (setf ,@(loop for (var) in bindings for s in saved append `(,var ,s)))))))

(defun stat (acceptor key) (getf (gallop:stats acceptor) key))

;;; Libraries Gallop does not ship (Clack, websocket-driver, hunchensocket):
;;; the tests that run them find them through ASDF, as a user's Quicklisp or
;;; source registry (CL_SOURCE_REGISTRY) provides them, and are skipped,
;;; with one line naming what to install, where they are absent.

(defun missing-systems (names)
  "The systems of NAMES that ASDF cannot find."
  (remove-if (lambda (name) (ignore-errors (asdf:find-system name nil))) names))

(defmacro with-optional-systems ((&rest names) &body body)
  "Run BODY when ASDF finds every system of NAMES; else skip the test, saying
which are missing and how to provide them."
  (let ((missing (gensym "MISSING")))
    `(let ((,missing (missing-systems ',names)))
       (if ,missing
           (skip "ASDF finds no ~{~A~^, ~}: install with Quicklisp, or name the sources ~
                  in CL_SOURCE_REGISTRY" ,missing)
           (progn ,@body)))))

(defun run-directory ()
  "This process's directory for the files tests make (certificates, bodies
served from disk): /tmp/gallop-tests-PID/, removed when RUN-ALL-TESTS ends."
  (let ((dir (uiop:ensure-directory-pathname
              (format nil "/tmp/gallop-tests-~D" (sb-posix:getpid)))))
    (ensure-directories-exist dir)
    dir))

(defun run-all-tests (&optional (tier :test))
  "Run a tier of tests: :TEST, the deterministic suite GALLOP (`make test`),
:STRESS, the suite STRESS of system gallop/stress (`make test-stress`), or
:RESTARTS, its restart drills alone (`make test-restarts`).
True when all passed.  Prints each skipped test with its reason, then
'N passed, N failed, N skipped'.  Removes RUN-DIRECTORY after the run,
passed or not."
  (let* ((suite (ecase tier (:test 'gallop) (:stress 'stress) (:restarts 'restarts)))
         (results (unwind-protect (let ((*print-names* t)) (run suite))
                    (uiop:delete-directory-tree (run-directory) :validate t
                                                                :if-does-not-exist :ignore)))
         (passed (count-if (lambda (r) (typep r 'it.bese.fiveam::test-passed)) results))
         (failed (count-if (lambda (r) (typep r 'it.bese.fiveam::test-failure)) results))
         (skipped (remove-if-not (lambda (r) (typep r 'it.bese.fiveam::test-skipped)) results)))
    (explain! results)
    (dolist (r skipped)
      (format t "~&skipped: ~(~A~): ~A~%"
              (it.bese.fiveam::name (it.bese.fiveam::test-case r)) (it.bese.fiveam::reason r)))
    (format t "~&~D passed, ~D failed, ~D skipped~%" passed failed (length skipped))
    (and (plusp passed) (zerop failed))))

(defun main (&optional (tier :test))
  "Run a tier of tests (RUN-ALL-TESTS) and quit, status 0 when all passed."
  (uiop:quit (if (run-all-tests tier) 0 1)))

(defun check-hunchentoot-version (version directory)
  "Print which Hunchentoot is loaded; quit with status 1 unless it is VERSION
from DIRECTORY (`make test-ht13`: a run against another Hunchentoot than the
one meant would pass for the wrong reason)."
  (let* ((system (asdf:find-system "hunchentoot"))
         (loaded (asdf:component-version system))
         (from (asdf:system-source-directory system)))
    (format t "~&Testing against Hunchentoot ~A from ~A~%" loaded from)
    (unless (and (equal loaded version) (equal (truename from) (truename directory)))
      (format t "~&Expected Hunchentoot ~A from ~A: not testing.~%" version directory)
      (uiop:quit 1))))
