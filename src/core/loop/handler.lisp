;;;; handler.lisp -- running the engine's handler on a request: its
;;;; deadline (HANDLER-TIMEOUT, an interrupt in its thread), the 503 when it
;;;; was cut short before answering, and what it says becomes of the
;;;; connection (keep-alive, close, detached, suspended).  Nothing a handler
;;;; signals reaches the worker's loop.

(in-package #:gallop.core)

(defvar *handler-connection* nil
  "In a worker, while it runs the engine's handler: the connection served.
A deadline interrupt acts only while this is bound to its connection.")

(defun arm-handler-deadline (c)
  "Note that this thread now runs the handler on C, and start C's handler
deadline, if the engine has one."
  (let ((timeout (engine-handler-timeout-ms (connection-engine c))))
    (setf (conn-slot c sent) 0
          (conn-slot c handler-serial) (logand (1+ (conn-slot c handler-serial))
                                                 most-positive-fixnum))
    ;; The deadline first: an older entry due now must not find this thread
    ;; marked as running the handler with an old deadline.
    (when (plusp timeout)
      (schedule c (+ (now-ms) timeout)))
    (setf (conn-slot c handler-thread) sb-thread:*current-thread*)))

(defun disarm-handler-deadline (c)
  "This thread no longer runs the handler on C.  Clears only this thread's
mark: after a hand-off (CONNECTION-SUSPEND) another thread may own C."
  (sb-ext:compare-and-swap (%conn-slot c handler-thread) sb-thread:*current-thread* nil))

(defun interrupt-handler (c thread serial seconds)
  "Make THREAD, if it still runs handler run number SERIAL on C, signal
HANDLER-TIMEOUT (SECONDS NIL: a stop cuts the request, counted in
:STOP-CUT).  Any thread.
  Once the handler detached C (CONNECTION-DETACH) its request is over and
the stream belongs to whichever thread it gave it to: no deadline cuts it,
and a stop only unwinds the handler (so that its worker can end) without
counting a cut; RUN-HANDLER then lets go of C as of any detached one,
writing nothing on it and closing nothing."
  (sb-thread:interrupt-thread
   thread
   (lambda ()
     ;; Runs in THREAD, at whatever it was doing: act only inside the
     ;; handler run meant, never in the worker's own bookkeeping.
     (when (and (eq *handler-connection* c)
                (eql (conn-slot c handler-serial) serial)
                (eq (conn-slot c handler-thread) sb-thread:*current-thread*))
       ;; DETACHING is set in this thread, with interrupts off.
       (cond ((conn-slot c detaching)
              (when (null seconds)
                (error 'handler-timeout :seconds nil)))
             (t
              (setf (conn-slot c interrupted) t)
              (when (and (null seconds) (null (conn-slot c stop-cut)))
                (setf (conn-slot c stop-cut) :cut)
                (sb-ext:atomic-incf (engine-stop-cut (connection-engine c))))
              ;; ERROR, not SIGNAL: unless something in the handler unwinds
              ;; it, RUN-HANDLER's HANDLER-CASE does.
              (error 'handler-timeout :seconds seconds)))))))

(defun stop-cut-message (c method path address port)
  "The log line of the request on C that a stop cut (see STOP-CUT), naming
its METHOD (a symbol or a string), PATH, the peer's ADDRESS (a string) and
PORT, and how long it ran; NIL when none is due: no stop cut it, or the line
was made already.  Called by the layer above, which knows the request, where
it catches HANDLER-TIMEOUT, and by RUN-HANDLER for a request it did not.
A layer that calls it logs the engine's 503 in its own access log, with the
request's fields (ANSWER-INTERRUPTED-HANDLER then logs none: one line per
answer)."
  (when (eq :cut (sb-ext:compare-and-swap (%conn-slot c stop-cut) :cut :reported))
    (let* ((owner (connection-owner-stream c))
           ;; On TLS through a library above, the request is read on the
           ;; plaintext connection (tls.lisp).
           (begun (request-begun (conn-slot (if (typep owner 'connection) owner c) request)))
           ;; REQUEST-BEGUN is read on the precise clock, in microseconds.
           (ms (and (plusp begun) (max 0 (floor (- (the fixnum (now-us)) begun) 1000)))))
      (format nil "Stopping: cut ~A ~A from ~A:~D~@[ after ~A s~]: its handler still ran ~
                   when the stop gave up waiting"
              (cond ((null method) "-") ((symbolp method) (symbol-name method)) (t method))
              (or path "-") (or address "-") port
              (and ms (multiple-value-bind (seconds rest) (floor ms 1000)
                        (format nil "~D.~3,'0D" seconds rest)))))))

(defun report-stop-cut (engine c)
  "Log the line of C's request if a stop cut it and the layer above did not
\(STOP-CUT-MESSAGE): with the method of C's record, but no path, which the
record no longer holds once a body was read."
  (when (eq (conn-slot c stop-cut) :cut)
    (let ((line (stop-cut-message c (request-method (conn-slot c request)) nil
                                  (let ((address (connection-remote-address c)))
                                    (cond ((null address) nil)
                                          ((= (length address) 4)
                                           (format nil "~{~D~^.~}" (coerce address 'list)))
                                          (t (format nil "~{~(~2,'0X~2,'0X~)~^:~}"
                                                     (coerce address 'list)))))
                                  (connection-remote-port c))))
      (when line
        (log-engine-error engine "~A" line)))))

(defun answer-interrupted-handler (engine c condition)
  "After HANDLER-TIMEOUT cut a handler short: log CONDITION (NIL: the layer
above caught and logged it), and answer 503 if no byte of a response went
out yet.  Over TLS the engine can't write for the handler: its layer answers."
  (when condition
    (log-engine-error engine "~A (~A)" condition c))
  (when (and (zerop (the fixnum (conn-slot c sent))) (not (engine-raw-p engine)))
    (setf (conn-slot c out-fill) 0)
    (let ((response (response-503 engine)))
      ;; After what is queued (an interim 100 Continue), never before it;
      ;; what the socket does not take now waits with C.  The request line
      ;; is at IN-START only while the handler has not taken the head.
      (note-refusal c response
                    (if (and (ignore-errors (send-all c response 0 (length response) :reference) t)
                             (not (conn-slot c gone)))
                        (length response)
                        0)
                    :line (plusp (the fixnum (request-head-left (connection-request c))))
                    ;; A stop's cut the layer above reported: it logged
                    ;; this 503 (STOP-CUT-MESSAGE).
                    :log (not (eq (conn-slot c stop-cut) :reported))))))

(defun let-go-detached (c)
  "The worker lets go of C, whose handler kept the stream (CONNECTION-DETACH),
its last act on C.  The stream's owner (the handler's own thread, or any it
gave the stream to) may have closed it already, before this: CLOSE then left
C to this worker, which closes it now.  One compare-and-swap on DETACHING
decides which of the two closes C (see CLOSE, stream.lisp): T until one of
them acts, then :LET-GO (this worker was first: CLOSE closes C) or :CLOSED
\(CLOSE was first)."
  (setf (connection-state c) :detached)
  (when (eq :closed (sb-ext:compare-and-swap (%conn-slot c detaching) t :let-go))
    (close-connection c)))

(defun run-handler (engine c)
  "Run the engine's handler on C, which returns what becomes of C:
:KEEP-ALIVE (done with this request; C may serve another), :CLOSE,
:DETACHED (it kept the stream) or :SUSPENDED (it called CONNECTION-SUSPEND:
another thread will finish the request).  Any serious condition the handler
lets escape (an error, or SBCL's control stack exhaustion, which is a
STORAGE-CONDITION, not an ERROR) is logged and closes C: it must never reach
the worker's thread, where it would kill the process or park the thread in
the debugger.  A handler cut short by its deadline closes C too, after a 503
if it had not answered.  Returns :PARK (C may be parked: SERVE-CONNECTION
still checks that the request ended cleanly), :CLOSE,
:DETACHED or :SUSPENDED."
  (with-connection-slots (boundary stream-closed head-started sent interrupted) c
    (setf boundary nil stream-closed nil head-started nil
          sent 0 interrupted nil (conn-slot c body-given) nil)
    (sb-ext:atomic-incf (tally-requests (connection-tally c)))
    (begin-in-flight c)
    (arm-handler-deadline c)
    (let ((outcome
            (unwind-protect
                 (handler-case (let ((*handler-connection* c))
                                 (funcall (the function (engine-handler engine)) c))
                   (handler-timeout (e)
                     (cond ((conn-slot c detaching)
                            ;; A stop unwound the handler of a stream it
                            ;; detached (INTERRUPT-HANDLER): its owner's.
                            :detached)
                           (t
                            ;; A stop's is reported as a cut request, below.
                            (answer-interrupted-handler engine c (and (handler-timeout-seconds e) e))
                            (setf interrupted :answered)
                            :close)))
                   (connection-error (e)
                     ;; The client went away or stalled (timeouts are
                     ;; counted where they happen): close, quietly.
                     (unless (typep e 'connection-timeout-error)
                       (note-client-abort engine))
                     :close)
                   (serious-condition (e)
                     (log-engine-error engine "Error serving ~A: ~A" c e)
                     :close))
              (disarm-handler-deadline c)
              (end-in-flight c))))
      (when (eq outcome :suspended)
        ;; Another thread owns C now (see CONNECTION-SUSPEND): hands off.
        (return-from run-handler :suspended))
      (when (and interrupted (conn-slot c detaching))
        ;; Cut short, the handler ran on and detached the stream: it is
        ;; its owner's, to end; nothing more is written on it.
        (setf interrupted nil))
      (when interrupted
        (unless (eq interrupted :answered)
          ;; The layer above caught HANDLER-TIMEOUT itself (Hunchentoot's
          ;; PROCESS-CONNECTION makes it an error it logs): still answer.
          (answer-interrupted-handler engine c nil))
        (report-stop-cut engine c)
        (setf outcome :close))
      (case outcome
        (:keep-alive :park)
        (:close :close)
        (:detached
         ;; The handler kept the stream: it is an ordinary stream from now
         ;; on, with no more events.  Unregister before anyone else may
         ;; close it (and the fd number be reused by a new connection).
         (epoll-ctl (group-epfd (connection-group c)) +epoll-ctl-del+ (connection-fd c) 0 0)
         (setf boundary nil)
         (let-go-detached c)
         :detached)
        (t
         (log-engine-error engine "The handler of ~A returned ~A, not :KEEP-ALIVE, ~
                                   :CLOSE, :DETACHED or :SUSPENDED." c
                           (let ((*print-length* 4) (*print-level* 2) (*print-readably* nil))
                             (prin1-to-string outcome)))
         :close)))))
