;;;; answers.lisp -- every answer Gallop writes itself is a valid HTTP/1.1
;;;; message (spec: issue 13), on both front ends: GALLOP:START with a
;;;; trivial app, and GALLOP:EASY-ACCEPTOR.  Each answer is read with the
;;;; strict reader of tests/strict-reader.lisp: the exact status line, Content-Type,
;;;; Content-Length equal to the body that follows, Connection: close (and
;;;; Retry-After for 503), then the end of the connection and nothing else.
;;;; curl must read each one an HTTP client can provoke and exit 0.
;;;;
;;;; Then the limits (414, 431, 413, and heads just under each) must give the
;;;; same status however the request is split into sends: whole, every
;;;; 1 KiB, one byte at a time.

(in-package #:gallop-tests)

(def-suite answers :in gallop :description "Gallop's own answers on the wire, and limits.")
(in-suite answers)

;;; The two front ends, serving the same two resources:
;;;   /wire-ok     reads the whole body and answers 200 "ok N" (N body bytes);
;;;   /wire-block  signals *WIRE-ENTERED*, waits for *WIRE-RELEASE*, then
;;;                answers like /wire-ok.

(defvar *wire-entered* nil "A semaphore /wire-block signals when it starts.")
(defvar *wire-release* nil "A semaphore /wire-block waits on (at most 20 s).")

(defun wire-block ()
  (when *wire-entered* (sb-thread:signal-semaphore *wire-entered*))
  (when *wire-release* (sb-thread:wait-on-semaphore *wire-release* :timeout 20)))

(defun count-stream-octets (stream)
  "Read STREAM (binary) to its end; how many octets it had."
  (let ((buffer (make-array 4096 :element-type '(unsigned-byte 8))))
    (loop for n = (read-sequence buffer stream)
          sum n
          while (= n (length buffer)))))

(defun wire-native-app (env)
  (when (string= (getf env :path-info) "/wire-block")
    (wire-block))
  (let ((n (count-stream-octets (getf env :raw-body))))
    (list 200 '(:content-type "text/plain") (list (format nil "ok ~D" n)))))

(defun wire-hunchentoot-answer ()
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "ok ~D" (length (hunchentoot:raw-post-data :force-binary t))))

(hunchentoot:define-easy-handler (handle-wire-ok :uri "/wire-ok") ()
  (wire-hunchentoot-answer))

(hunchentoot:define-easy-handler (handle-wire-block :uri "/wire-block") ()
  (wire-block)
  (wire-hunchentoot-answer))

(defparameter *front-ends* '(:native :easy)
  ":NATIVE is GALLOP:START with WIRE-NATIVE-APP; :EASY is GALLOP:EASY-ACCEPTOR
with a GALLOP:TASKMASTER.")

(defun call-with-front-end (kind options function &key (app #'wire-native-app))
  "Start front end KIND with OPTIONS (the initargs GALLOP:START and
GALLOP:TASKMASTER share: :MAX-REQUEST-LINE-BYTES, :MAX-HEAD-BYTES,
:MAX-BODY-BYTES, :HEADER-TIMEOUT, :MAX-THREAD-COUNT, :STANDBY-THREAD-COUNT,
:MAX-QUEUE-LENGTH), call FUNCTION with its port and the server, and always
stop it.  :NATIVE serves APP; :EASY the easy handlers defined."
  (ecase kind
    (:native
     (let ((server (apply #'gallop:start app
                          :address "127.0.0.1" :port 0
                          :log (message-log-destination) options)))
       (unwind-protect (funcall function (gallop:server-port server) server)
         (gallop:stop server))))
    (:easy
     (let ((server (make-server 'gallop:easy-acceptor
                                :taskmaster (apply #'make-instance 'gallop:taskmaster options))))
       (hunchentoot:start server)
       (unwind-protect (funcall function (port-of server) server)
         (when (hunchentoot:started-p server)
           (hunchentoot:stop server)))))))

(defmacro with-front-end ((port server kind options) &body body)
  "Run BODY with front end KIND started with OPTIONS (a form giving the
initargs), PORT and SERVER bound."
  `(call-with-front-end ,kind ,options
                        (lambda (,port ,server) (declare (ignorable ,server)) ,@body)))

;;; What a valid answer of Gallop's own looks like

(defparameter *gallop-reasons*
  '((400 . "Bad Request") (408 . "Request Timeout") (413 . "Content Too Large")
    (414 . "URI Too Long") (431 . "Request Header Fields Too Large")
    (501 . "Not Implemented") (503 . "Service Unavailable")
    (505 . "HTTP Version Not Supported"))
  "The reason phrases of the answers Gallop writes itself (RFC 9110 15).")

(defun gallop-answer-body (status)
  (format nil "~D ~A~%" status (cdr (assoc status *gallop-reasons*))))

(defun check-gallop-answer (what answer status)
  "Check that ANSWER (read by READ-WIRE-OR-ERROR with :CLOSE) is exactly the
STATUS answer Gallop writes itself: the status line, Content-Type,
Content-Length of the body that follows, Connection: close, Retry-After for
503, that body, then the end of the connection."
  (let ((reason (cdr (assoc status *gallop-reasons*))))
    (cond
      ((not (wire-response-p answer))
       (fail "~A: not a valid answer: ~A" what answer))
      (t
       (let* ((body (gallop-answer-body status))
              (expected `(("Content-Type" . "text/plain; charset=utf-8")
                          ("Content-Length" . ,(princ-to-string (length body)))
                          ("Connection" . "close")
                          ,@(when (= status 503) '(("Retry-After" . "1")))))
              (line (octets (format nil "HTTP/1.1 ~D ~A~C~C" status reason #\Return #\Linefeed))))
         (is (= status (wire-status answer)) "~A: status ~D, expected ~D" what (wire-status answer) status)
         (is (equalp line (subseq (wire-head answer) 0 (min (length line) (length (wire-head answer)))))
             "~A: status line ~S" what (latin1 (wire-head answer) 0 (position 13 (wire-head answer))))
         (is (and (= (length expected) (length (wire-headers answer)))
                  (null (set-exclusive-or expected (wire-headers answer) :test #'equal)))
             "~A: headers ~S, expected ~S" what (wire-headers answer) expected)
         (is (string= body (wire-body-string answer)) "~A: body ~S" what (wire-body-string answer))
         (is (wire-flag-p answer :eof) "~A: the connection did not end after the answer" what))))))

(defun check-ok-answer (what answer body-length &key close)
  "Check that ANSWER is the front end's 200 \"ok BODY-LENGTH\", framed by
Content-Length, and (CLOSE) says Connection: close and ended the connection."
  (cond
    ((not (wire-response-p answer))
     (fail "~A: not a valid answer: ~A" what answer))
    (t
     (let ((body (format nil "ok ~D" body-length)))
       (is (= 200 (wire-status answer)) "~A: status ~D, expected 200" what (wire-status answer))
       (is (string= "OK" (wire-reason answer)) "~A: reason ~S" what (wire-reason answer))
       (is (wire-flag-p answer :content-length) "~A: not framed by Content-Length" what)
       (is (string= body (wire-body-string answer)) "~A: body ~S, expected ~S"
           what (wire-body-string answer) body)
       (if close
           (progn
             (is (equalp "close" (wire-header answer "Connection"))
                 "~A: Connection ~S, expected close" what (wire-header answer "Connection"))
             (is (wire-flag-p answer :eof) "~A: the connection did not end" what))
           (is (not (equalp "close" (wire-header answer "Connection")))
               "~A: Connection: close on a keep-alive answer" what))))))

(defun raw-exchange (port text &key (close t) before-read)
  "Send TEXT on a new connection to PORT (then call BEFORE-READ with the
socket, if given) and read one answer strictly; the answer, or the
WIRE-ERROR."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket text)
           (when before-read (funcall before-read socket))
           (read-wire-or-error socket :close close))
      (usocket:socket-close socket))))

;;; curl

(defun read-file-octets (path)
  (with-open-file (in path :element-type '(unsigned-byte 8))
    (let ((octets (make-array (file-length in) :element-type '(unsigned-byte 8))))
      (read-sequence octets in)
      octets)))

(defun run-curl (url &rest arguments)
  "Run curl --http1.1 on URL with ARGUMENTS, the body saved to a file.
Returns curl's exit code, the status it printed, the body, and its stderr."
  (uiop:with-temporary-file (:pathname out :prefix "gallop-curl")
    (multiple-value-bind (output error-output code)
        (uiop:run-program (append (list "curl" "-s" "-S" "--http1.1" "--max-time" "20"
                                        "-o" (namestring out) "-w" "%{http_code}")
                                  arguments (list url))
                          :output :string :error-output :string :ignore-error-status t)
      (values code output (map 'string #'code-char (read-file-octets out)) error-output))))

(defmacro with-data-file ((path size) &body body)
  "Bind PATH to the name of a temporary file of SIZE bytes of x."
  `(uiop:with-temporary-file (:stream out :pathname ,path :prefix "gallop-data"
                              :element-type '(unsigned-byte 8))
     (write-sequence (make-array ,size :element-type '(unsigned-byte 8) :initial-element 120) out)
     :close-stream
     (let ((,path (namestring ,path))) ,@body)))

(defun check-curl (what status url &rest arguments)
  "curl on URL with ARGUMENTS exits 0 and reads STATUS and (for an error
Gallop writes) its body."
  (multiple-value-bind (code printed body stderr) (apply #'run-curl url arguments)
    (is (eql 0 code) "~A: curl exited ~A: ~A" what code stderr)
    (is (equal (princ-to-string status) printed) "~A: curl read status ~S, expected ~D"
        what printed status)
    (when (assoc status *gallop-reasons*)
      (is (string= (gallop-answer-body status) body) "~A: curl saved the body ~S" what body))
    (values body stderr)))

;;; 400 408 413 414 431 501 505, and 100 Continue

(defparameter *answer-limits*
  '(:max-request-line-bytes 1024 :max-head-bytes 16384 :max-body-bytes 1000 :header-timeout 1)
  "The limits of the server the error answers come from.  The 414 line and
the 431 head are over their limit by more than the 8 KiB a first read takes
in, so they are refused however the head is split (see the segmentation
tests for the limits themselves).")

(defun pad (n) (make-string n :initial-element #\a))

(defparameter *raw-error-requests*
  `(("bad request line" 400 ,(crlf "GET  /wire-ok HTTP/1.1" "Host: x"))
    ("header name with a space" 400 ,(crlf "GET /wire-ok HTTP/1.1" "Host: x" "Bad Name: x"))
    ("Content-Length over the limit" 413 ,(crlf "POST /wire-ok HTTP/1.1" "Host: x" "Content-Length: 1001"))
    ("Content-Length over the limit, expecting 100-continue" 413
     ,(crlf "POST /wire-ok HTTP/1.1" "Host: x" "Content-Length: 1001" "Expect: 100-continue"))
    ("request line over the limit" 414 ,(crlf (format nil "GET /wire-ok?p=~A HTTP/1.1" (pad 9000)) "Host: x"))
    ("head over the limit" 431 ,(crlf "GET /wire-ok HTTP/1.1" "Host: x" (format nil "X-Pad: ~A" (pad 17000))))
    ("Transfer-Encoding: gzip" 501 ,(crlf "POST /wire-ok HTTP/1.1" "Host: x" "Transfer-Encoding: gzip"))
    ("HTTP/2.0" 505 ,(crlf "GET /wire-ok HTTP/2.0" "Host: x")))
  "Name, the status Gallop must answer, and the request.")

(defun check-error-answers (kind)
  (with-front-end (port server kind *answer-limits*)
    (loop for (name status text) in *raw-error-requests*
          for what = (format nil "~(~A~) ~A" kind name)
          do (check-gallop-answer what (raw-exchange port text) status))
    ;; 408: half a head, then nothing until the header timeout (1 s).
    (check-gallop-answer (format nil "~(~A~) header timeout" kind)
                         (raw-exchange port (format nil "GET /wire-ok HTTP/1.1~C~CHost: x~C~C"
                                                    #\Return #\Linefeed #\Return #\Linefeed))
                         408)
    ;; The same errors from curl (an HTTP/1.1 version other than 1.x and half
    ;; a head it cannot send).
    (let ((url (format nil "http://127.0.0.1:~D/wire-ok" port)))
      (check-curl (format nil "~(~A~) curl 400" kind) 400 url "-H" "Bad Name: x")
      (with-data-file (data 2000)
        (check-curl (format nil "~(~A~) curl 413" kind) 413 url "--data-binary" (format nil "@~A" data)))
      (check-curl (format nil "~(~A~) curl 414" kind) 414 (format nil "~A?p=~A" url (pad 9000)))
      (check-curl (format nil "~(~A~) curl 431" kind) 431 url "-H" (format nil "X-Pad: ~A" (pad 17000)))
      (check-curl (format nil "~(~A~) curl 501" kind) 501 url "-H" "Transfer-Encoding: gzip"))
    ;; and the server still serves
    (check-ok-answer (format nil "~(~A~) after the errors" kind)
                     (raw-exchange port (crlf "GET /wire-ok HTTP/1.1" "Host: x") :close nil) 0)))

(test error-answers-are-valid-http-native (check-error-answers :native))
(test error-answers-are-valid-http-easy-acceptor (check-error-answers :easy))

(defparameter *continue-octets* (octets (format nil "HTTP/1.1 100 Continue~C~C~C~C"
                                                 #\Return #\Linefeed #\Return #\Linefeed)))

(defun check-continue (kind)
  "Expect: 100-continue gets exactly HTTP/1.1 100 Continue CRLF CRLF before
the body is sent, then the final answer; with Content-Length and chunked."
  (with-front-end (port server kind *answer-limits*)
    (loop for (framing head body) in
          `(("Content-Length" ,(crlf "POST /wire-ok HTTP/1.1" "Host: x" "Content-Length: 5"
                                     "Expect: 100-continue")
                              "hello")
            ("chunked" ,(crlf "POST /wire-ok HTTP/1.1" "Host: x" "Transfer-Encoding: chunked"
                              "Expect: 100-continue")
                       ,(format nil "5~C~Chello~C~C0~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed
                                #\Return #\Linefeed #\Return #\Linefeed)))
          for what = (format nil "~(~A~) 100 Continue, ~A" kind framing)
          do (let ((socket (connect port)))
               (unwind-protect
                    (progn
                      (send socket head)
                      (let ((interim (read-wire-or-error socket)))
                        (cond ((wire-response-p interim)
                               (is (equalp *continue-octets* (wire-head interim))
                                   "~A: ~S" what (latin1 (wire-head interim)))
                               (is (zerop (length (wire-body interim)))))
                              (t (fail "~A: ~A" what interim))))
                      (send socket body)
                      (let ((final (read-wire-or-error socket)))
                        ;; RFC 9110 lets a client take more 1xx answers, but
                        ;; one 100 is the answer to one expectation: a
                        ;; second, after the body was sent, means two layers
                        ;; both answered it.
                        (when (and (wire-response-p final) (= 100 (wire-status final)))
                          (fail "~A: a second 100 Continue came after the body" what)
                          (setf final (read-wire-or-error socket)))
                        (check-ok-answer what final 5)))
                 (usocket:socket-close socket))))
    ;; curl waits for the 100 (up to a second) before it sends the body.
    (with-data-file (data 5)
      (multiple-value-bind (body stderr)
          (check-curl (format nil "~(~A~) curl 100-continue" kind) 200
                      (format nil "http://127.0.0.1:~D/wire-ok" port)
                      "-v" "-H" "Expect: 100-continue" "--data-binary" (format nil "@~A" data))
        (is (string= "ok 5" body))
        (is (search "< HTTP/1.1 100 Continue" stderr) "curl saw no 100: ~A" stderr)))))

(test continue-is-exact-native (check-continue :native))
(test continue-is-exact-easy-acceptor (check-continue :easy))

;;; 503: overload, with one worker and no queue

(defun check-overload (kind)
  "One worker, a queue of one: with the worker blocked and one connection
queued, every new connection gets 503 with Retry-After at once.  (A queue of
none would make the test depend on the worker being counted idle at the
moment the first connection is accepted, which it is not while it passes
through its loop, e.g. after a GC.)"
  (with-globals ((*wire-entered* (sb-thread:make-semaphore))
                 (*wire-release* (sb-thread:make-semaphore)))
    (with-front-end (port server kind '(:max-thread-count 1 :standby-thread-count 1
                                       :max-queue-length 1))
      (let ((busy (connect port))
            (queued nil))
        (unwind-protect
             (progn
               ;; The only worker blocks in /wire-block ...
               (send busy (crlf "GET /wire-block HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *wire-entered* :timeout 10))
               ;; ... one more connection fills the queue ...
               (setf queued (connect port))
               (send queued (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
               (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :pending)))))
               ;; ... so a new connection gets 503 at once, from raw sockets and curl.
               (check-gallop-answer (format nil "~(~A~) overload" kind)
                                    (raw-exchange port (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
                                    503)
               (check-curl (format nil "~(~A~) curl 503" kind) 503
                           (format nil "http://127.0.0.1:~D/wire-ok" port))
               (sb-thread:signal-semaphore *wire-release*)
               (check-ok-answer (format nil "~(~A~) the blocked request" kind)
                                (read-wire-or-error busy) 0)
               (check-ok-answer (format nil "~(~A~) the queued request" kind)
                                (read-wire-or-error queued) 0))
          (sb-thread:signal-semaphore *wire-release* 10)
          (when queued (usocket:socket-close queued))
          (usocket:socket-close busy))))))

(test overload-answer-is-valid-http-native (check-overload :native))
(test overload-answer-is-valid-http-easy-acceptor (check-overload :easy))

(defun check-silent-connections-do-not-overload (kind)
  "One worker, a queue of one, the worker blocked: twenty connections that
send nothing and five that send part of a head do not fill the queue, so a client with a request is still
accepted and served once the worker is free; a silent one that then sends
its request is served too."
  (with-globals ((*wire-entered* (sb-thread:make-semaphore))
                 (*wire-release* (sb-thread:make-semaphore)))
    (with-front-end (port server kind '(:max-thread-count 1 :standby-thread-count 1
                                       :max-queue-length 1))
      (let ((busy (connect port))
            (silent '())
            (client nil))
        (unwind-protect
             (progn
               (send busy (crlf "GET /wire-block HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *wire-entered* :timeout 10))
               (setf silent (loop repeat 20 collect (connect port)))
               ;; Five more send part of a head: no more work than silence.
               (loop repeat 5
                     do (let ((socket (connect port)))
                          (send socket (format nil "GET /wire-ok HTTP/1.1~C~CHost: x~C~C"
                                               #\Return #\Linefeed #\Return #\Linefeed))
                          (setf silent (append silent (list socket)))))
               (is (wait-until (lambda () (= 26 (getf (gallop:stats server) :open))))
                   "~(~A~): the silent connections were not accepted: ~S" kind (gallop:stats server))
               (sleep 0.2)
               (is (zerop (getf (gallop:stats server) :pending)))
               ;; A client with a request waits for the worker, not 503.
               (setf client (connect port))
               (send client (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
               (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :pending))))
                   "~(~A~): the request is not waiting: ~S" kind (gallop:stats server))
               (is (zerop (getf (gallop:stats server) :shed)))
               (sb-thread:signal-semaphore *wire-release*)
               (check-ok-answer (format nil "~(~A~) the blocked request" kind)
                                (read-wire-or-error busy) 0)
               (check-ok-answer (format nil "~(~A~) the request beside silent connections" kind)
                                (read-wire-or-error client) 0)
               ;; A silent connection that speaks at last is served.
               (send (first silent) (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
               (check-ok-answer (format nil "~(~A~) a silent connection's late request" kind)
                                (read-wire-or-error (first silent)) 0)
               (is (zerop (getf (gallop:stats server) :pending))))
          (sb-thread:signal-semaphore *wire-release* 10)
          (mapc #'usocket:socket-close silent)
          (when client (usocket:socket-close client))
          (usocket:socket-close busy))))))

(test silent-connections-do-not-overload-native
  (check-silent-connections-do-not-overload :native))
(test silent-connections-do-not-overload-easy-acceptor
  (check-silent-connections-do-not-overload :easy))

;;; A soft stop: a request already sent on an idle keep-alive connection is
;;; answered, with Connection: close, and the connection then ends.

(defun front-end-stopping-p (kind server)
  "True once SERVER's engine stops (for both front ends, a soft stop is the
engine's, before Hunchentoot's own STOP sets its shutdown flag)."
  (declare (ignore kind))
  (let ((engine (gallop::server-engine-of server)))
    (or (null engine) (not (gallop.core:engine-running-p engine)))))

(defun check-soft-stop (kind)
  (with-globals ((*wire-entered* (sb-thread:make-semaphore))
                 (*wire-release* (sb-thread:make-semaphore)))
    (with-front-end (port server kind '(:max-thread-count 1 :standby-thread-count 1))
      (let ((idle (connect port))
            (busy (connect port))
            (stopper nil))
        (unwind-protect
             (progn
               ;; A keep-alive connection, answered once and idle.
               (send idle (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
               (check-ok-answer (format nil "~(~A~) before the stop" kind) (read-wire-or-error idle) 0)
               ;; The only worker blocks; the idle connection sends its next
               ;; request, which waits for a worker.
               (send busy (crlf "GET /wire-block HTTP/1.1" "Host: x"))
               (is (sb-thread:wait-on-semaphore *wire-entered* :timeout 10))
               (send idle (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
               ;; Soft stop; once it began, the worker is freed.
               (setf stopper (sb-thread:make-thread
                              (lambda ()
                                (ecase kind
                                  (:native (gallop:stop server :soft t))
                                  (:easy (hunchentoot:stop server :soft t))))
                              :name "soft stop"))
               (is (wait-until (lambda () (front-end-stopping-p kind server)) :timeout 10))
               (sb-thread:signal-semaphore *wire-release*)
               (let ((blocked (read-wire-or-error busy :close t)))
                 ;; The request in flight is answered (whether it says
                 ;; Connection: close is not the point here: it must be valid
                 ;; and the connection must end after it).
                 (if (wire-response-p blocked)
                     (progn (is (= 200 (wire-status blocked)))
                            (is (string= "ok 0" (wire-body-string blocked))))
                     (fail "~(~A~) the request in flight: ~A" kind blocked)))
               (check-ok-answer (format nil "~(~A~) the request sent before the stop" kind)
                                (read-wire-or-error idle :close t) 0 :close t))
          (sb-thread:signal-semaphore *wire-release* 10)
          (when stopper (sb-thread:join-thread stopper :default nil :timeout 30))
          (usocket:socket-close idle)
          (usocket:socket-close busy))))))

(test soft-stop-answer-is-valid-http-native (check-soft-stop :native))
(test soft-stop-answer-is-valid-http-easy-acceptor (check-soft-stop :easy))

;;; Segmentation: a limit never depends on how the bytes were split.

(defun request-with-line (length)
  "A GET whose request line is LENGTH bytes without its CRLF."
  (let ((fixed (length "GET /wire-ok?p= HTTP/1.1")))
    (crlf (format nil "GET /wire-ok?p=~A HTTP/1.1" (pad (- length fixed))) "Host: x")))

(defun request-with-head (length)
  "A GET whose head, with its final empty line, is LENGTH bytes."
  (let ((fixed (length (crlf "GET /wire-ok HTTP/1.1" "Host: x" "X-Pad: "))))
    (crlf "GET /wire-ok HTTP/1.1" "Host: x" (format nil "X-Pad: ~A" (pad (- length fixed))))))

(defun request-with-body (length &key (send-body t))
  "A POST declaring a LENGTH byte body (and sending it, with SEND-BODY)."
  (concatenate 'string
               (crlf "POST /wire-ok HTTP/1.1" "Host: x" (format nil "Content-Length: ~D" length))
               (if send-body (pad length) "")))

(defun limit-cases (line head body)
  "Name, the status, and the request, for the limits LINE, HEAD and BODY.
\"Over\" is over under any reading of what the limit counts (with or without
the line's CRLF, with or without the head's final empty line); \"under\" is
within it under any reading."
  `(("request line just under the limit" 200 ,(request-with-line (- line 2)) 0)
    ("request line just over the limit" 414 ,(request-with-line (1+ line)))
    ("head just under the limit" 200 ,(request-with-head head) 0)
    ("head just over the limit" 431 ,(request-with-head (+ head 5)))
    ("body at the limit" 200 ,(request-with-body body) ,body)
    ("body over the limit" 413 ,(request-with-body (1+ body) :send-body nil))))

(defun send-split (socket text piece pause)
  "Send TEXT in pieces of PIECE octets (NIL: whole), flushing each, with
PAUSE seconds between them so that each is a read of its own.  Stops quietly
if the server stopped reading: it answered already."
  (let* ((octets (octets text))
         (stream (usocket:socket-stream socket))
         (piece (or piece (length octets))))
    (setf (sb-bsd-sockets:sockopt-tcp-nodelay (usocket:socket socket)) t)
    (handler-case
        (loop for start from 0 below (length octets) by piece
              do (write-sequence octets stream :start start :end (min (length octets) (+ start piece)))
                 (force-output stream)
                 (when (and pause (< (+ start piece) (length octets)))
                   (sleep pause)))
      (stream-error () nil))))

(defparameter *limit-sets*
  ;; (line head body) and the splits to send them with
  '(((4096 16384 16384) (:whole :kib))
    ((1024 2048 2048) (:whole :kib :byte))))

(defun check-limit-answer (what answer status body-length end)
  "Check ANSWER (a WIRE-RESPONSE, or the WIRE-ERROR read instead) to the limit
case WHAT, which expects STATUS: a request served gets its body of
BODY-LENGTH octets; a refused one Gallop's own answer, after which END (a
function of ANSWER) checks that the connection ended, returning ANSWER or a
WIRE-ERROR."
  (cond ((not (wire-response-p answer))
         (fail "~A: not a valid answer: ~A" what answer))
        ((/= status (wire-status answer))
         (fail "~A: answered ~D, expected ~D" what (wire-status answer) status))
        ((= status 200)
         (check-ok-answer what answer body-length))
        (t
         (check-gallop-answer what (funcall end answer) status))))

(defun check-limits-whatever-the-split (kind)
  (loop for ((line head body) splits) in *limit-sets*
        do (with-front-end (port server kind (list :max-request-line-bytes line
                                                   :max-head-bytes head :max-body-bytes body))
             (loop for (name status text body-length) in (limit-cases line head body)
                   do (dolist (split splits)
                        (let ((what (format nil "~(~A~), limits ~D/~D/~D, ~A, sent ~(~A~)"
                                            kind line head body name split))
                              (socket (connect port)))
                          (unwind-protect
                               (progn
                                 (ecase split
                                   (:whole (send-split socket text nil nil))
                                   (:kib (send-split socket text 1024 0.005))
                                   (:byte (send-split socket text 1 0.0002)))
                                 ;; The status first: a request served when it
                                 ;; should have been refused leaves the
                                 ;; connection open, and waiting for its end
                                 ;; would only say so later.
                                 (check-limit-answer
                                  what (read-wire-or-error socket) status body-length
                                  (lambda (answer)
                                    (handler-case (read-wire-end socket answer)
                                      (wire-error (e) e)))))
                            (usocket:socket-close socket))))))))

(test limits-do-not-depend-on-segmentation-native (check-limits-whatever-the-split :native))
(test limits-do-not-depend-on-segmentation-easy-acceptor (check-limits-whatever-the-split :easy))
