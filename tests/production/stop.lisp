;;;; stop.lisp -- a soft stop drops nothing: what waits on the listen socket
;;;; is served before the socket is shut, requests on idle keep-alive
;;;; connections are answered with Connection: close, the readiness URL
;;;; fails while it drains, and STOP-TIMEOUT bounds it; on both front ends.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the housekeeper's epoll
;;;; set and the listen fd (EPOLL-CTL, ENGINE-HOUSEKEEPER-EPFD, ENGINE-
;;;; LISTEN-FD) to pause accepting as a busy housekeeper does; ENGINE-
;;;; ACCEPTING-ENDED, the moment a soft stop shut the listen socket;
;;;; RESPONSE-503, the engine's own pre-encoded answer a stop's cut must send
;;;; octet for octet.

(in-package #:gallop-tests)

(in-suite production)

(defvar *stop-gate* nil "A semaphore /stop-block waits on (at most 120 s).")
(defvar *stop-entered* nil "A semaphore /stop-block signals when it starts.")

(defun stop-block ()
  (when *stop-entered* (sb-thread:signal-semaphore *stop-entered*))
  (when *stop-gate* (sb-thread:wait-on-semaphore *stop-gate* :timeout 120)))

(defparameter *stop-big-body* (make-string (* 1024 1024) :initial-element #\x)
  "What /stop-big answers: more than the socket takes at once.")

(defun stop-native-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/ready") (gallop:readiness-response env))
          ((string= path "/stop-big")
           (stop-block)
           (list 200 '(:content-type "text/plain") (list *stop-big-body*)))
          ((string= path "/stop-block") (stop-block) '(200 (:content-type "text/plain") ("Hey!")))
          ((string= path "/stop-streamed") (stop-native-streamed env))
          ((string= path "/stop-partial")
           (lambda (responder)
             (let ((writer (funcall responder '(200 (:content-type "text/plain"
                                                     :content-length "100")))))
               (funcall writer "partial")
               (stop-block)
               (funcall writer "never" :close t))))
          (t '(200 (:content-type "text/plain") ("Hey!"))))))

(hunchentoot:define-easy-handler (handle-stop-ready :uri "/ready") ()
  (gallop:readiness))

(hunchentoot:define-easy-handler (handle-stop-big :uri "/stop-big") ()
  (stop-block)
  (setf (hunchentoot:content-type*) "text/plain")
  *stop-big-body*)

(hunchentoot:define-easy-handler (handle-stop-block :uri "/stop-block") ()
  (stop-block)
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(defparameter *stop-streamed-body* "Streamed while stopping."
  "What the answers whose heads go out before their bodies carry.")

(defvar *stop-static-file* nil
  "The file /stop-static serves with HUNCHENTOOT:HANDLE-STATIC-FILE.")

(defun stop-native-streamed (env)
  "A delayed answer whose head goes out through the writer before its body."
  (declare (ignore env))
  (lambda (responder)
    (let ((writer (funcall responder '(200 (:content-type "text/plain")))))
      (funcall writer *stop-streamed-body* :close t))))

(hunchentoot:define-easy-handler (handle-stop-send-headers :uri "/stop-send-headers") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) (length *stop-streamed-body*))
  (let ((stream (hunchentoot:send-headers)))
    (write-sequence (map '(vector (unsigned-byte 8)) #'char-code *stop-streamed-body*) stream)
    (finish-output stream)
    nil))

(hunchentoot:define-easy-handler (handle-stop-partial :uri "/stop-partial") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) 100)
  (let ((stream (hunchentoot:send-headers)))
    (write-sequence (map '(vector (unsigned-byte 8)) #'char-code "partial") stream)
    (finish-output stream)
    (stop-block)
    (write-sequence (map '(vector (unsigned-byte 8)) #'char-code "never") stream)
    nil))

(hunchentoot:define-easy-handler (handle-stop-static :uri "/stop-static") ()
  (hunchentoot:handle-static-file *stop-static-file* "text/plain"))

(defun start-stop-server (kind port &rest settings &key reuse-port log access-log
                          &allow-other-keys)
  "Front end KIND (:NATIVE, :EASY; :STOCK, Hunchentoot's own EASY-ACCEPTOR
with a GALLOP:TASKMASTER) on 127.0.0.1:PORT (0: any) with SETTINGS
\(GALLOP:START's keywords, GALLOP:TASKMASTER's initargs), REUSE-PORT, LOG
\(a stream for the message log, or the tests' usual one) and ACCESS-LOG (a
file for the access log, or none)."
  (let ((settings (loop for (key value) on settings by #'cddr
                        unless (member key '(:reuse-port :log :access-log))
                          append (list key value)))
        (log (or log (message-log-destination))))
    (ecase kind
      (:native (apply #'gallop:start #'stop-native-app :address "127.0.0.1" :port port
                                                       :log log :access-log access-log
                                                       :reuse-port reuse-port settings))
      ;; MAKE-SERVER's own :PORT 0 comes after, and so loses.
      (:easy (hunchentoot:start
              (make-server 'gallop:easy-acceptor
                           :port port :reuse-port reuse-port
                           :message-log-destination log
                           :access-log-destination access-log
                           :taskmaster (apply #'make-instance 'gallop:taskmaster settings))))
      (:stock (hunchentoot:start
               (make-server 'hunchentoot:easy-acceptor
                            :port port :message-log-destination log
                            :access-log-destination access-log
                            :taskmaster (apply #'make-instance 'gallop:taskmaster settings)))))))

(defun stop-server (kind server &key soft)
  (ecase kind
    (:native (gallop:stop server :soft soft))
    ((:easy :stock) (when (hunchentoot:started-p server) (hunchentoot:stop server :soft soft)))))

(defun server-port-of (kind server)
  (ecase kind
    (:native (gallop:server-port server))
    ((:easy :stock) (port-of server))))

(defun pause-accepting (server)
  "Take SERVER's listen socket out of its housekeeper's epoll set: connections
wait in the socket's queue, as they do while the housekeeper is busy."
  (let ((engine (gallop::server-engine-of server)))
    (gallop.core::epoll-ctl (gallop.core::engine-housekeeper-epfd engine)
                            gallop.core::+epoll-ctl-del+
                            (gallop.core::engine-listen-fd engine) 0 0)))

(defun soft-stop-in-thread (kind server)
  (sb-thread:make-thread (lambda () (stop-server kind server :soft t)) :name "soft stop"))

(defun joined-p (thread &key (timeout 60))
  "True when THREAD ended within TIMEOUT seconds (a bound no correct stop
comes near: a stop that waits for a grace it should have left hangs)."
  (not (eq :timeout (sb-thread:join-thread thread :default :timeout :timeout timeout))))

(test a-soft-stop-serves-what-waits-on-its-listen-socket
  "Two servers share a port (:REUSE-PORT).  One stops accepting, and 16
clients connect and send a request: those the kernel gave to its queue wait
there.  Its soft stop accepts and answers them (with Connection: close)
before it shuts the socket, where closing it would reset them; afterwards
the kernel gives every new connection to the other server."
  (dolist (kind '(:native :easy))
    (let* ((a (start-stop-server kind 0 :reuse-port t))
           (port (server-port-of kind a))
           (b (start-stop-server kind port :reuse-port t))
           (clients '()))
      (unwind-protect
           (progn
             (pause-accepting a)
             (dotimes (i 16)
               (let ((client (connect port)))
                 (push client clients)
                 (send client (crlf "GET /yo HTTP/1.1" "Host: x"))))
             (let ((stopper (soft-stop-in-thread kind a))
                   (closing 0))
               (dolist (client clients)
                 (let ((answer (read-wire-or-error client)))
                   (is (exact-answer-p answer "Hey!") "~(~A~): ~A" kind answer)
                   (when (and (wire-response-p answer)
                              (equalp "close" (wire-header answer "Connection")))
                     (incf closing))))
               (is (joined-p stopper) "~(~A~): the soft stop ended" kind)
               ;; 16 clients all sent to the other server: once in 65,536.
               (is (plusp closing) "~(~A~): the stopped server answered none" kind))
             (let ((answers (spread-over port 16)))
               (is (every (lambda (answer) (exact-answer-p answer "Hey!")) answers)
                   "~(~A~) after the stop: ~S" kind
                   (find-if-not (lambda (answer) (exact-answer-p answer "Hey!")) answers))))
        (mapc #'usocket:socket-close clients)
        (stop-server kind b)
        (stop-server kind a)))))

(test a-soft-stop-answers-idle-connections-with-connection-close
  "During a soft stop, idle keep-alive connections stay open (here, for a
grace longer than the test): a request sent on one is answered, with
Connection: close, then the connection ends; the readiness URL answers 503
from the start of the stop, and new connections are refused.  The stop
ends once no connection is left, not at the end of the grace."
  (dolist (kind '(:native :easy))
    (let* ((server (start-stop-server kind 0 :stop-idle-grace 600))
           (port (server-port-of kind server))
           (ready (connect port))
           (yo (connect port))
           (stopper nil))
      (unwind-protect
           (progn
             (send ready (crlf "GET /ready HTTP/1.1" "Host: x"))
             (let ((answer (read-wire-or-error ready)))
               (is (exact-answer-p answer "ready") "~(~A~) running: ~A" kind answer))
             (send yo (crlf "GET /yo HTTP/1.1" "Host: x"))
             (is (exact-answer-p (read-wire-or-error yo) "Hey!"))
             (setf stopper (soft-stop-in-thread kind server))
             (is (wait-until (lambda ()
                               (let ((engine (gallop::server-engine-of server)))
                                 (or (null engine)
                                     (gallop.core::engine-accepting-ended engine))))
                             :timeout 30)
                 "~(~A~): accepting ended" kind)
             (is (not (gallop:ready-p server)))
             (send ready (crlf "GET /ready HTTP/1.1" "Host: x"))
             (let ((answer (read-wire-or-error ready :close t)))
               (is (and (wire-response-p answer)
                        (= 503 (wire-status answer))
                        (string= "draining" (wire-body-string answer))
                        (equalp "close" (wire-header answer "Connection")))
                   "~(~A~) draining: ~A" kind answer))
             (send yo (crlf "GET /yo HTTP/1.1" "Host: x"))
             (let ((answer (read-wire-or-error yo :close t)))
               (is (and (exact-answer-p answer "Hey!")
                        (equalp "close" (wire-header answer "Connection")))
                   "~(~A~) the request on an idle connection: ~A" kind answer))
             (is (null (ignore-errors (usocket:socket-close (connect port)) t))
                 "~(~A~): a new connection was accepted" kind)
             (is (joined-p stopper) "~(~A~): the soft stop ended" kind))
        (usocket:socket-close ready)
        (usocket:socket-close yo)
        (when (and stopper (sb-thread:thread-alive-p stopper))
          (sb-thread:join-thread stopper :default nil))
        (stop-server kind server)))))

(test a-soft-stop-s-answers-written-head-first-say-connection-close
  "During a soft stop, an answer whose head goes out before its body (a
Hunchentoot handler calling SEND-HEADERS, HANDLE-STATIC-FILE, a native
streaming writer) says Connection: close, whatever Hunchentoot decided
before writing it, and the connection then ends: its client sends its next
request elsewhere instead of on a connection the stop closes."
  (with-globals ((*stop-static-file* (merge-pathnames "stop-static.txt" (run-directory))))
    (let ((static-body (with-output-to-string (out)
                         (dotimes (i 200) (format out "Line ~D of a static file.~%" i)))))
      (with-open-file (out *stop-static-file* :direction :output :if-exists :supersede)
        (write-string static-body out))
      (dolist (kind '(:native :easy))
        (let* ((server (start-stop-server kind 0 :stop-idle-grace 600))
               (port (server-port-of kind server))
               (cases (ecase kind
                        (:native `(("/stop-streamed" ,*stop-streamed-body*)))
                        (:easy `(("/stop-send-headers" ,*stop-streamed-body*)
                                 ("/stop-static" ,static-body)))))
               (clients (loop repeat (length cases) collect (connect port)))
               (stopper nil))
          (unwind-protect
               (progn
                 ;; Each connection kept alive by a first answer.
                 (dolist (client clients)
                   (send client (crlf "GET /yo HTTP/1.1" "Host: x"))
                   (is (exact-answer-p (read-wire-or-error client) "Hey!")))
                 (setf stopper (soft-stop-in-thread kind server))
                 (is (wait-until (lambda ()
                                   (let ((engine (gallop::server-engine-of server)))
                                     (or (null engine)
                                         (gallop.core::engine-accepting-ended engine))))
                                 :timeout 30)
                     "~(~A~): accepting ended" kind)
                 (loop for (path body) in cases
                       for client in clients
                       do (send client (crlf (format nil "GET ~A HTTP/1.1" path) "Host: x"))
                          (let ((answer (read-wire-or-error client :close t)))
                            (is (and (wire-response-p answer)
                                     (= 200 (wire-status answer))
                                     (string= body (wire-body-string answer))
                                     (equalp "close" (wire-header answer "Connection"))
                                     (null (wire-header answer "Keep-Alive")))
                                "~(~A~) ~A during the stop: ~A" kind path answer)))
                 (is (joined-p stopper) "~(~A~): the soft stop ended" kind))
            (mapc #'usocket:socket-close clients)
            (when (and stopper (sb-thread:thread-alive-p stopper))
              (sb-thread:join-thread stopper :default nil))
            (stop-server kind server)))))))

(defun log-lines-with (text log)
  "The lines of the string LOG that contain TEXT."
  (remove-if-not (lambda (line) (search text line))
                 (uiop:split-string log :separator '(#\Newline))))

;;; A request whose handler waits on *STOP-GATE* until its stop cuts it.

(defmacro with-cut-request ((kind server engine client log) (kinds path &key access-log)
                            &body body)
  "For each KIND of KINDS: a server with a STOP-TIMEOUT of 1 s logging to LOG
\(ENGINE its engine) and writing its access log to the file ACCESS-LOG (if
any), and CLIENT, whose GET of PATH its handler entered; BODY runs then, and
the handler, the client and the server are always let go."
  `(dolist (,kind ,kinds)
     (with-globals ((*stop-gate* (sb-thread:make-semaphore))
                    (*stop-entered* (sb-thread:make-semaphore)))
       (let* ((,log (make-string-output-stream))
              (,server (start-stop-server ,kind 0 :stop-timeout 1 :log ,log
                                                  :access-log ,access-log))
              (,engine (gallop::server-engine-of ,server))
              (,client (connect (server-port-of ,kind ,server) :timeout 60)))
         (unwind-protect
              (progn
                (send ,client (crlf (format nil "GET ~A HTTP/1.1" ,path) "Host: x"))
                (is (sb-thread:wait-on-semaphore *stop-entered* :timeout 30))
                ,@body)
           (sb-thread:signal-semaphore *stop-gate* 10)
           (usocket:socket-close ,client)
           (stop-server ,kind ,server))))))

(test a-soft-stop-cuts-what-outlasts-its-stop-timeout
  "A handler that would run for two minutes does not hold a soft stop past
STOP-TIMEOUT (1 s here): it is interrupted, and its client gets the engine's
503 (Connection: close, Retry-After), the same octets on both front ends,
then the end of the connection.  One line of the message log names the
request (method, path without its query, the peer's address and port, how
long it ran, about the stop's timeout; Hunchentoot's at level WARNING), and
the stats and the metrics count it.  The same on a stock acceptor served by GALLOP:TASKMASTER, whose
HANDLE-REQUEST is Hunchentoot's."
  (with-cut-request (kind server engine client log) ('(:native :easy :stock) "/stop-block?key=s3cret")
    (let ((stopper (soft-stop-in-thread kind server))
          (start (get-internal-real-time)))
      (is (joined-p stopper) "~(~A~): the soft stop ended" kind)
      ;; Ten times the timeout, and half the default one: a stop
      ;; that ignored it would take 20 s.
      (is (< (- (get-internal-real-time) start)
             (* 10 internal-time-units-per-second))
          "~(~A~): the soft stop took ~,1F s" kind
          (/ (- (get-internal-real-time) start) internal-time-units-per-second)))
    (let ((octets (read-to-eof (usocket:socket-stream client))))
      (is (equalp (gallop.core::response-503 engine) octets)
          "~(~A~): the client read ~S" kind (map 'string #'code-char octets)))
    (let* ((text (get-output-stream-string log))
           (lines (log-lines-with "Stopping: cut" text))
           (request (format nil "GET /stop-block from 127.0.0.1:~D "
                            (usocket:get-local-port client))))
      (is (= 1 (length lines)) "~(~A~): the log says~%~A" kind text)
      (is (and lines
               (search request (first lines))
               ;; It ran through most of the stop's timeout, 1 s: the stop
               ;; reads its deadline on the coarse clock, a tick (up to 10
               ;; ms) behind the precise one the duration is read on.
               (cl-ppcre:register-groups-bind ((#'parse-integer seconds millis))
                   (" after ([0-9]+)\\.([0-9]{3}) s" (first lines))
                 (>= (+ (* 1000 seconds) millis) 900))
               (not (search "s3cret" (first lines)))
               (or (eq kind :native) (search "[WARNING]" (first lines))))
          "~(~A~): the line ~S names not ~S, its duration, or its level"
          kind (first lines) request))
    (is (eql 1 (getf (gallop.core:engine-stats engine) :stop-cut)) "~(~A~)" kind)
    (multiple-value-bind (table error) (parse-metrics (gallop.core:engine-metrics engine))
      (is (and table (= 1 (metric-value table "gallop_stop_cut_total{}")))
          "~(~A~): ~A" kind (or error (and table (metric-value table "gallop_stop_cut_total{}")))))))

(test a-soft-stop-cuts-an-answer-under-way-without-a-503
  "A handler that sent its head and part of its body, then blocks, is cut at
STOP-TIMEOUT like any other (logged once, counted), but its client gets no
503 after what it read: only the end of the connection."
  (with-cut-request (kind server engine client log) ('(:native :easy) "/stop-partial")
    (is (joined-p (soft-stop-in-thread kind server)) "~(~A~): the soft stop ended" kind)
    (let* ((text (map 'string #'code-char (read-to-eof (usocket:socket-stream client))))
           (end (search (coerce '(#\Return #\Linefeed #\Return #\Linefeed) 'string)
                        text)))
      (is (and (uiop:string-prefix-p "HTTP/1.1 200 " text)
               end
               (string= "partial" (subseq text (+ end 4))))
          "~(~A~): the client read ~S" kind text))
    (is (= 1 (length (log-lines-with "Stopping: cut GET /stop-partial from "
                                     (get-output-stream-string log))))
        "~(~A~)" kind)
    (is (eql 1 (getf (gallop.core:engine-stats engine) :stop-cut)) "~(~A~)" kind)))

(test a-soft-stop-waits-for-a-slow-reader-of-a-late-answer
  "A handler still running when the idle grace ends answers 1 MiB to a client
that reads nothing yet: the soft stop waits for the client to read it all
\(within STOP-TIMEOUT) rather than closing the connection under it."
  (dolist (kind '(:native :easy))
    (with-globals ((*stop-gate* (sb-thread:make-semaphore))
                   (*stop-entered* (sb-thread:make-semaphore)))
      (let* ((server (start-stop-server kind 0 :stop-idle-grace 0.05))
             (port (server-port-of kind server))
             (client (connect port :timeout 60))
             (stopper nil))
        (unwind-protect
             (progn
               (send client (crlf "GET /stop-big HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *stop-entered* :timeout 30))
               (setf stopper (soft-stop-in-thread kind server))
               ;; Past the grace (a bound, not a wait for an event: the
               ;; stop must not end while the handler runs, whenever it
               ;; returns).
               (sleep 0.5)
               (sb-thread:signal-semaphore *stop-gate*)
               (is (wait-until (lambda ()
                                 (let ((engine (gallop::server-engine-of server)))
                                   (and engine
                                        (zerop (getf (gallop.core:engine-stats engine) :in-flight)))))
                               :timeout 30))
               (sleep 0.2)
               (let ((answer (read-wire-or-error client :close t)))
                 (is (and (wire-response-p answer)
                          (= 200 (wire-status answer))
                          (= (length *stop-big-body*) (length (wire-body answer))))
                     "~(~A~): ~A" kind (if (wire-response-p answer)
                                           (length (wire-body answer))
                                           answer)))
               (is (joined-p stopper) "~(~A~): the soft stop ended" kind))
          (sb-thread:signal-semaphore *stop-gate* 10)
          (usocket:socket-close client)
          (when (and stopper (sb-thread:thread-alive-p stopper))
            (sb-thread:join-thread stopper :default nil))
          (stop-server kind server))))))

(test a-second-stop-waits-for-the-first
  "Two stops at once (a SIGTERM's beside the application's own): the second
returns only when the engine has stopped, not while the first still waits
for a request in flight, so that it cannot close what that stop still uses.
The request is answered.  (GALLOP:START's STOP only: Hunchentoot's own STOP,
which runs after Gallop's, is not made to be called twice at once.)"
  (dolist (kind '(:native))
    (with-globals ((*stop-gate* (sb-thread:make-semaphore))
                   (*stop-entered* (sb-thread:make-semaphore)))
      (let* ((server (start-stop-server kind 0))
             (port (server-port-of kind server))
             (engine (gallop::server-engine-of server))
             (client (connect port :timeout 60))
             (first nil) (second nil))
        (unwind-protect
             (progn
               (send client (crlf "GET /stop-block HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *stop-entered* :timeout 30))
               (setf first (soft-stop-in-thread kind server))
               (is (wait-until (lambda () (not (gallop.core:engine-running-p engine))) :timeout 30))
               (setf second (soft-stop-in-thread kind server))
               ;; The handler cannot end before the gate opens, nor the
               ;; first stop (its timeout is 20 s): the second must wait.
               (sleep 0.5)
               (is (sb-thread:thread-alive-p second) "~(~A~): the second stop returned" kind)
               (sb-thread:signal-semaphore *stop-gate*)
               (is (joined-p first))
               (is (joined-p second))
               (is (exact-answer-p (read-wire-or-error client) "Hey!") "~(~A~)" kind))
          (sb-thread:signal-semaphore *stop-gate* 10)
          (usocket:socket-close client)
          (stop-server kind server))))))

(test a-stop-cut-request-has-one-access-log-line
  "The 503 a stop's cut answers is logged once in the access log, as the
request's answer: its method and path, 503 and the octets of its body."
  (flet ((access-log (kind)
           (merge-pathnames (format nil "stop-cut-~(~A~).log" kind) (run-directory))))
    (with-cut-request (kind server engine client log)
        ('(:native :easy :stock) "/stop-block"
         :access-log (let ((path (access-log kind)))
                       (when (probe-file path) (delete-file path))
                       path))
      (is (joined-p (soft-stop-in-thread kind server)) "~(~A~): the soft stop ended" kind)
      (let ((octets (read-to-eof (usocket:socket-stream client))))
        (is (equalp (gallop.core::response-503 engine) octets)
            "~(~A~): the client read ~S" kind (map 'string #'code-char octets)))
      ;; The stop wrote what its access log held.
      (let ((lines (log-lines (access-log kind)))
            (want (format nil "\"GET /stop-block HTTP/1.1\" 503 ~D "
                          (gallop.core:error-body-bytes 503))))
        (is (and (= 1 (length lines)) (search want (first lines)))
            "~(~A~): the access log holds ~S, not one line with ~S" kind lines want)))))

;;; A handler that detaches its stream, gives it to another thread (the
;;; test's), then blocks on *STOP-GATE* until its stop unwinds it.

(defvar *stop-detached* nil "The stream /stop-detach detached.")

(defparameter *stop-detached-answer* "echo: hello"
  "The body the thread given /stop-detach's stream writes.")

(hunchentoot:define-easy-handler (handle-stop-detach :uri "/stop-detach") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) (length *stop-detached-answer*))
  (let ((stream (hunchentoot:send-headers)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (setf *stop-detached* stream)
    (stop-block))
  nil)

(defun echo-a-line-as-owner (stream)
  "As the thread a handler gave its detached STREAM to: read a line, write
\"echo: \" and the line, close.  :DONE, or the error that stopped it."
  (handler-case
      (let ((line (loop for b = (read-byte stream nil nil)
                        until (or (null b) (= b 10))
                        collect (code-char b))))
        (write-sequence (octets (format nil "echo: ~{~C~}" line)) stream)
        (finish-output stream)
        (close stream)
        :done)
    (error (e) e)))

(test a-stop-leaves-a-detached-stream-to-its-owner
  "A handler that detached its stream (HUNCHENTOOT:DETACH-SOCKET) and gave
it to another thread still runs when a soft stop gives up waiting: the stop
unwinds the handler, but writes nothing on the stream and closes nothing.
The owner then reads what the client sends and answers it; the client reads
the head and exactly what the owner wrote.  No cut is counted or logged, and
no 503 answered."
  (with-globals ((*stop-detached* nil))
    (with-cut-request (kind server engine client log) ('(:easy :stock) "/stop-detach")
      (let ((stream *stop-detached*))
        (is (joined-p (soft-stop-in-thread kind server)) "~(~A~): the soft stop ended" kind)
        (send client (format nil "hello~C" #\Linefeed))
        (let ((owner (echo-a-line-as-owner stream)))
          (is (eq :done owner) "~(~A~): the owner's reads and writes failed: ~A" kind owner))
        (let* ((text (map 'string #'code-char (read-to-eof (usocket:socket-stream client))))
               (end (search (coerce '(#\Return #\Linefeed #\Return #\Linefeed) 'string) text)))
          (is (and (uiop:string-prefix-p "HTTP/1.1 200 " text)
                   end
                   (string= *stop-detached-answer* (subseq text (+ end 4))))
              "~(~A~): the client read ~S" kind text))
        (is (null (log-lines-with "Stopping: cut" (get-output-stream-string log))) "~(~A~)" kind)
        (is (eql 0 (getf (gallop.core:engine-stats engine) :stop-cut)) "~(~A~)" kind)
        (multiple-value-bind (table error) (parse-metrics (gallop.core:engine-metrics engine))
          (is (and table (= 0 (+ (metric-value table (answers-key "GET" "5xx"))
                                 (metric-value table (answers-key "other" "5xx")))))
              "~(~A~): ~A" kind (or error "a 503 counted")))))))

(hunchentoot:define-easy-handler (handle-detach-outlast :uri "/detach-outlast") ()
  ;; /stop-detach, but the handler returns by itself, 3 s on: past its
  ;; deadline (1 s in the test), which must not cut it.
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) (length *stop-detached-answer*))
  (let ((stream (hunchentoot:send-headers)))
    (hunchentoot:detach-socket hunchentoot:*acceptor*)
    (setf *stop-detached* stream)
    (sb-thread:signal-semaphore *stop-entered*)
    (sb-thread:wait-on-semaphore *stop-gate* :timeout 3))
  nil)

(test a-handler-deadline-leaves-a-detached-stream-to-its-owner
  "A handler that detached its stream and gave it to another thread, then
ran past its deadline: its request is over, and the deadline cuts nothing.
Once it returned, the owner reads what the client sends and answers it; the
client reads the head and exactly what the owner wrote.  (Were the deadline
to cut the handler, it would do so 2 s before the handler returns.)"
  (with-globals ((*stop-detached* nil)
                 (*stop-gate* (sb-thread:make-semaphore))
                 (*stop-entered* (sb-thread:make-semaphore)))
    (with-server (server 'gallop:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster :handler-timeout 1))
      (let ((client (connect (port-of server) :timeout 60))
            (engine (gallop::server-engine-of server)))
        (unwind-protect
             (progn
               (send client (crlf "GET /detach-outlast HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *stop-entered* :timeout 30))
               (is (wait-until (lambda () (zerop (getf (gallop.core:engine-stats engine) :in-flight)))
                               :timeout 30))
               (send client (format nil "hello~C" #\Linefeed))
               (let* ((stream *stop-detached*)
                      (owner (echo-a-line-as-owner stream)))
                 (is (eq :done owner) "the owner's reads and writes failed: ~A" owner))
               (let* ((text (map 'string #'code-char (read-to-eof (usocket:socket-stream client))))
                      (end (search (coerce '(#\Return #\Linefeed #\Return #\Linefeed) 'string)
                                   text)))
                 (is (and (uiop:string-prefix-p "HTTP/1.1 200 " text)
                          end
                          (string= *stop-detached-answer* (subseq text (+ end 4))))
                     "the client read ~S" text)))
          (sb-thread:signal-semaphore *stop-gate* 10)
          (usocket:socket-close client))))))
